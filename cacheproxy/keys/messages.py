"""Chat messages -> canonical `Message`s: roles merged, content flattened, tool turns checked.

What a turn may hold: `content` (a string or text parts; an assistant's may be null, which
is the empty string, as mlx_lm.server renders it), `name`, an assistant's `tool_calls`
(arguments as a JSON object, sent as a string or an object) and `reasoning_content` (or its
alias `reasoning`), a tool turn's `tool_call_id`. The legacy forms map onto these: an
assistant's `function_call` is a tool call with id `function-call-<message index>`, and a
`role: "function"` turn answers the latest such call of its name. Fields an SDK echoes back
from a response with no value (`refusal`, `audio`, `annotations`, `function_call` as null or
empty) are accepted; any other field is refused, never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from cacheproxy.errors import InvalidRequest, Unsupported
from cacheproxy.keys.tools import dumps, ordered

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool", "function": "tool"}
_KNOWN = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "function_call",
                    "reasoning", "reasoning_content"})
_EMPTY_ECHOES = frozenset({"refusal", "audio", "annotations"})


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call in the history: its id, function name and arguments (JSON object text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    """One chat turn."""

    role: str
    content: str
    name: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    reasoning: str = ""

    def wire(self) -> dict[str, Any]:
        """Plain data for the key and the record: the fields that are set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [[c.id, c.name, c.arguments] for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning:
            out["reasoning"] = self.reasoning
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Message:
        """Inverse of `wire`."""
        calls = tuple(ToolCall(*c) for c in data.get("tool_calls", ()))
        return cls(data["role"], data["content"], data.get("name", ""), calls,
                   data.get("tool_call_id", ""), data.get("reasoning", ""))

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (tool-call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": orjson.loads(c.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        return out


def text_content(value: object, where: str, *, nullable: bool = False) -> str:
    """A string, or text parts joined; null is empty where it may be null."""
    if value is None and nullable:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise Unsupported(f"'{where}' supports only text parts", param=where)
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"'{where}' text parts need a string 'text'", param=where)
            parts.append(text)
        return "".join(parts)
    raise InvalidRequest(f"'{where}' must be a string or a list of text parts", param=where)


def messages(body: Mapping[str, Any]) -> tuple[Message, ...]:
    """Every turn of `messages`, checked; tool turns must answer an earlier call."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    out: list[Message] = []
    calls: dict[str, str] = {}  # every tool call id so far -> its function name
    for i, m in enumerate(raw):
        message = _message(m, f"messages[{i}]", i, calls)
        calls.update((c.id, c.name) for c in message.tool_calls)
        out.append(message)
    return tuple(out)


def _message(m: object, where: str, index: int, calls: dict[str, str]) -> Message:
    if not isinstance(m, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    _refuse_unknown(m, where)
    raw_role = m.get("role")
    role = ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise InvalidRequest(f"'{where}.role' must be one of {sorted(ROLES)}",
                             param=f"{where}.role")
    # Only an assistant turn may leave its content out (a turn of tool calls).
    content = text_content(m.get("content"), f"{where}.content", nullable=role == "assistant")
    name = _string(m, "name", where)
    if role == "assistant":
        if m.get("tool_call_id") is not None:
            raise InvalidRequest(f"'{where}.tool_call_id' is for tool turns",
                                 param=f"{where}.tool_call_id")
        return Message(role, content, name, _assistant_calls(m, where, index),
                       reasoning=_reasoning(m, where))
    for field in ("tool_calls", "function_call", "reasoning", "reasoning_content"):
        if m.get(field) not in (None, [], "", {}):
            raise InvalidRequest(f"'{where}.{field}' is for assistant turns",
                                 param=f"{where}.{field}")
    if role == "tool":
        return Message(role, content, name, tool_call_id=_answered(m, where, str(raw_role),
                                                                   calls))
    if m.get("tool_call_id") is not None:
        raise InvalidRequest(f"'{where}.tool_call_id' is for tool turns",
                             param=f"{where}.tool_call_id")
    return Message(role, content, name)


def _refuse_unknown(m: dict[str, Any], where: str) -> None:
    for field, value in m.items():
        if field in _KNOWN or (field in _EMPTY_ECHOES and value in (None, "", [], {})):
            continue
        raise Unsupported(f"'{where}.{field}' is not supported in a message",
                          param=f"{where}.{field}")


def _string(m: Mapping[str, Any], field: str, where: str) -> str:
    value = m.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"'{where}.{field}' must be a string", param=f"{where}.{field}")
    return value


def _reasoning(m: Mapping[str, Any], where: str) -> str:
    first = _string(m, "reasoning_content", where)
    second = _string(m, "reasoning", where)
    if first and second and first != second:
        raise InvalidRequest(f"'{where}.reasoning' and 'reasoning_content' differ",
                             param=f"{where}.reasoning")
    return first or second


def _assistant_calls(m: Mapping[str, Any], where: str, index: int) -> tuple[ToolCall, ...]:
    raw, legacy = m.get("tool_calls"), m.get("function_call")
    if legacy not in (None, {}):  # {} and null: echoed empty
        if raw:
            raise InvalidRequest(f"'{where}' has both 'tool_calls' and 'function_call'",
                                 param=f"{where}.function_call")
        return (_call({"id": f"function-call-{index}", "function": legacy},
                      f"{where}.function_call"),)
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequest(f"'{where}.tool_calls' must be a list", param=f"{where}.tool_calls")
    found = tuple(_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw))
    ids = [c.id for c in found]
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"'{where}.tool_calls' repeats an id", param=f"{where}.tool_calls")
    return found


def _call(raw: object, where: str) -> ToolCall:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    if raw.get("type", "function") != "function":
        raise Unsupported(f"'{where}.type' must be 'function'", param=f"{where}.type")
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"'{where}.id' must be a non-empty string", param=f"{where}.id")
    function = raw.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest(f"'{where}.function' needs a string 'name'",
                             param=f"{where}.function")
    return ToolCall(call_id, function["name"], _arguments(function.get("arguments"), where))


def _arguments(raw: object, where: str) -> str:
    field = f"{where}.function.arguments"
    value: Any = raw
    if isinstance(raw, str):
        try:
            value = orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            raise InvalidRequest(f"'{field}' is not valid JSON", param=field) from None
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{field}' must be a JSON object", param=field)
    return dumps(ordered(value))


def _answered(m: Mapping[str, Any], where: str, raw_role: str, calls: dict[str, str]) -> str:
    """The id of the call a tool turn answers: its tool_call_id, or (legacy `function`
    turn) the latest call of its name."""
    if raw_role == "function":
        name = _string(m, "name", where)
        legacy = [i for i, n in calls.items() if n == name and i.startswith("function-call-")]
        if not legacy:
            raise InvalidRequest(f"'{where}' answers no earlier function_call named {name!r}",
                                 param=f"{where}.name")
        return legacy[-1]
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"'{where}.tool_call_id' is required in a tool turn",
                             param=f"{where}.tool_call_id")
    if call_id not in calls:
        raise InvalidRequest(f"'{where}.tool_call_id' {call_id!r} answers no earlier tool call",
                             param=f"{where}.tool_call_id")
    return call_id
