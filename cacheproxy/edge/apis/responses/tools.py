"""A Responses request's tools as chat function tools, and the thought it asks to carry.

- A `function` tool becomes a chat function tool.
- A `namespace` tool (Codex sends `multi_agent_v1`) groups function tools: each becomes a
  chat function tool under its own name, which is how the model calls it and how the call is
  rendered back (`name`, plus the `namespace` it came from). A chat template has no place for
  a namespace's own description, so the prompt never shows it: it is echoed, and not keyed.
- A hosted tool (`web_search`, `file_search`, `code_interpreter`...) runs on OpenAI's
  servers; this server runs no tools, so it is refused by name (400), with how to turn it
  off where a client turns it on by default (Codex's `web_search`).
- `include: ["reasoning.encrypted_content"]` asks for the thought in a form the client sends
  back with a stateless (`store: false`) history. This server keeps no state and has nothing
  to hide: the "encrypted" content is the thought itself, encoded (`seal`); an input
  reasoning item that carries one gives the thought back exactly (`unseal`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from cacheproxy.errors import InvalidRequest, Unsupported

ENCRYPTED_REASONING = "reasoning.encrypted_content"
# Parts of items this server never produces: the hosted tools and input images are refused by
# name, so there is never such an item to add them to, as OpenAI answers a request without them.
_VACUOUS_INCLUDES = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs"})
_WEB_SEARCH = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                         "web_search_2025_08_26"})
_HOSTED = _WEB_SEARCH | {"file_search", "code_interpreter", "computer_use_preview", "computer",
                         "image_generation", "mcp", "local_shell", "shell", "apply_patch",
                         "tool_search"}
_SEAL = "cpx1."


def includes(body: Mapping[str, Any]) -> frozenset[str]:
    """The `include` values, each honoured or (for parts of items never produced) moot;
    a value this server could serve but does not (logprobs) or an unknown one is a 400."""
    raw = body.get("include")
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise InvalidRequest("'include' must be a list of strings", param="include")
    for value in raw:
        if value == "message.output_text.logprobs":
            raise Unsupported("'include' value 'message.output_text.logprobs' is not "
                              "supported by this server's Responses API", param="include")
        if value != ENCRYPTED_REASONING and value not in _VACUOUS_INCLUDES:
            allowed = sorted(_VACUOUS_INCLUDES | {ENCRYPTED_REASONING})
            raise InvalidRequest(f"'include' value {value!r} is not one of {allowed}",
                                 param="include")
    return frozenset(raw)


def tools(raw: object) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The chat function tools of a Responses `tools` list, and the namespace of each
    function that came from one (function name -> namespace name)."""
    if not isinstance(raw, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_function(tool))
        elif kind == "namespace":
            for function in _namespace(tool, where):
                out.append(function)
                namespaces[function["function"]["name"]] = tool["name"]
        else:
            raise _unsupported(kind, f"{where}.type")
    _unique(out)
    return out, namespaces


def _function(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if k in tool}
    return {"type": "function", "function": function}


def _namespace(tool: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    name, inner = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' must be a non-empty string", param=f"{where}.name")
    if not isinstance(tool.get("description", ""), str):
        raise InvalidRequest(f"'{where}.description' must be a string",
                             param=f"{where}.description")
    if not isinstance(inner, list) or not inner:
        raise InvalidRequest(f"'{where}.tools' must be a non-empty list", param=f"{where}.tools")
    out = []
    for j, function in enumerate(inner):
        kind = function.get("type") if isinstance(function, dict) else None
        if kind != "function":
            raise Unsupported(f"'{where}.tools[{j}].type' {kind!r}: a namespace's tools must "
                              "be function tools here", param=f"{where}.tools[{j}].type")
        out.append(_function(function))
    return out


def _unique(found: list[dict[str, Any]]) -> None:
    """A namespace's functions are offered by their own names: two of one name is a 400."""
    seen: set[str] = set()
    for tool in found:
        name = tool["function"].get("name")
        if isinstance(name, str) and name in seen:
            raise InvalidRequest(f"'tools' offer the function {name!r} twice (a namespace's "
                                 "functions are offered by their own names)", param="tools")
        if isinstance(name, str):
            seen.add(name)


def _unsupported(kind: object, where: str) -> Unsupported:
    if kind in _WEB_SEARCH:
        return Unsupported(
            f"'{where}' {kind!r}: this server cannot search the web (a hosted tool runs on "
            "OpenAI's servers). In Codex, turn it off with web_search = \"disabled\" in "
            "~/.codex/config.toml (or `codex -c web_search=disabled`)", param=where)
    if kind in _HOSTED:
        return Unsupported(f"'{where}' {kind!r}: a hosted tool runs on OpenAI's servers and "
                           "this server runs no tools; offer a function tool instead",
                           param=where)
    return Unsupported(f"'{where}' {kind!r}: only function and namespace tools are supported",
                       param=where)


def seal(thought: str) -> str:
    """The `encrypted_content` of a reasoning item: its thought, encoded (not secret)."""
    return _SEAL + base64.urlsafe_b64encode(thought.encode()).decode()


def unseal(token: object, where: str) -> str:
    """The thought of an `encrypted_content` this server wrote; 400 for any other."""
    try:
        if isinstance(token, str) and token.startswith(_SEAL):
            return base64.urlsafe_b64decode(token[len(_SEAL):].encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise InvalidRequest(f"'{where}' was not written by this server, which cannot read "
                         "another's encrypted reasoning: send the thought as the item's "
                         "content instead", param=where)
