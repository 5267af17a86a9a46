"""The path a chat-level error names, as the API the request came in by names it.

A Responses or Messages request is translated into the chat request that asks for the same
answer, and that request is checked as chat's (`canonical.parse`) and generated (the runner):
an error there names a chat path (`max_tokens`, `response_format.json_schema.schema`,
`tools[2].function.parameters`). Each API says where its fields went (`Paths`: a table of
chat prefixes, and where each chat tool, turn and call came from), and `renamed` gives the
error back with the API's own path, in its `param` and where its message quotes it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cacheproxy.errors import ProxyError

_INDEXED = re.compile(r"(tools|messages)\[(\d+)\](?:\.tool_calls\[(\d+)\])?(.*)")


@dataclass(frozen=True, slots=True)
class Origin:
    """Where one chat tool, turn or call came from: its path, and its fields' renames
    (chat's suffix -> the API's, the first that matches; one of "" renames everything)."""

    path: str
    fields: Sequence[tuple[str, str]] = ()

    def of(self, rest: str) -> str:
        """The API's path of a chat path under this origin (`rest`: what follows it)."""
        for chat, api in self.fields:
            if rest == chat or rest.startswith((chat + ".", chat + "[")):
                return self.path + api + rest[len(chat):]
        return self.path + rest


@dataclass(frozen=True, slots=True)
class Paths:
    """Where the fields of a chat translation came from in the API's request."""

    prefixes: Sequence[tuple[str, str]]  # (chat path prefix, the API's), most specific first
    tools: Sequence[Origin] = ()  # of each chat tool
    messages: Sequence[Origin] = ()  # of each chat turn
    calls: Mapping[tuple[int, int], Origin] = field(default_factory=dict)  # (turn, call)

    def of(self, path: str) -> str:
        """The API's path of a chat path (itself when the API names it alike)."""
        indexed = _INDEXED.fullmatch(path)
        if indexed is not None:
            kind, i, call, rest = indexed.groups()
            found = (self.calls.get((int(i), int(call))) if call is not None
                     else _at(self.tools if kind == "tools" else self.messages, int(i)))
            if found is not None:
                return found.of(rest)
        for chat, api in self.prefixes:
            if path == chat or path.startswith((chat + ".", chat + "[")):
                return api + path[len(chat):]
        return path


def _at(origins: Sequence[Origin], index: int) -> Origin | None:
    return origins[index] if index < len(origins) else None


def renamed(error: ProxyError, paths: Paths) -> ProxyError:
    """The error naming the API's path where it named a chat one (a copy; else itself)."""
    chat = error.param
    if chat is None or paths.of(chat) == chat:
        return error
    api = paths.of(chat)
    out = type(error).__new__(type(error))  # (not copy.copy: that calls __init__ with
    out.__dict__.update(error.__dict__)  # args, which ContextLengthExceeded's are not)
    out.param = api
    # Quoted, as most messages name it; bare too when it cannot be a plain word (max_tokens).
    named = re.escape(chat) if re.search(r"[_.\[]", chat) else f"'{re.escape(chat)}'"
    out.message = re.sub(rf"(?<![\w.\[]){named}(?![\w\[])",
                         lambda m: m[0].replace(chat, api), error.message)
    out.args = (out.message,)
    return out
