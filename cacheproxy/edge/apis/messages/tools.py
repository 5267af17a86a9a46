"""A Messages request's `tools` and `tool_choice` as their chat forms.

Client tools (an `input_schema`) are chat function tools; a tool with `defer_loading` is checked
and not shown to the model (as with Anthropic's tool search until a search loads it: this
server has no tool search), so `tool_choice` cannot name one, and `any` needs a tool shown.
`tool_choice`: `auto`, `any` = required, `tool` = that function, `none`;
`disable_parallel_tool_use` is parallel_tool_calls false.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cacheproxy.edge.apis.messages.turns import unknown
from cacheproxy.errors import InvalidRequest, Unsupported
from cacheproxy.keys import fields
from cacheproxy.keys.tools import NAME, check_schema

_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "strict",
                        "cache_control", "eager_input_streaming", "input_examples",
                        "defer_loading", "allowed_callers"})


def tools(body: Mapping[str, Any], chat: dict[str, Any]) -> set[str]:
    """`tools` as chat's, into `chat`; the names of the deferred ones (not shown)."""
    if body.get("tools") is None:
        return set()
    if not isinstance(body["tools"], list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    offered = [_tool(t, f"tools[{i}]") for i, t in enumerate(body["tools"])]
    chat["tools"] = [tool for tool in offered if tool is not None]
    return {t["name"] for t, shown in zip(body["tools"], offered, strict=True) if shown is None}


def _tool(raw: object, where: str) -> dict[str, Any] | None:
    """The chat tool of a Messages tool (None when deferred: its definition is not shown to
    the model, as with Anthropic's tool search until a search loads it)."""
    if not isinstance(raw, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    if raw.get("type") not in (None, "custom"):
        raise Unsupported(f"'{where}.type' {raw['type']!r}: only client tools with an "
                          "input_schema are supported (Anthropic's server and built-in tools "
                          "run on Anthropic's side)", param=f"{where}.type")
    unknown(raw, _TOOL_KEYS, where)
    if raw.get("input_examples"):
        raise Unsupported(f"'{where}.input_examples' is not supported (put examples in the "
                          "description)", param=f"{where}.input_examples")
    if raw.get("allowed_callers") not in (None, ["direct"]):
        raise Unsupported(f"'{where}.allowed_callers' other than direct is not supported",
                          param=f"{where}.allowed_callers")
    fields.boolean(raw, "eager_input_streaming", False)  # each call is streamed whole anyway
    deferred = fields.boolean(raw, "defer_loading", False)
    if not isinstance(raw.get("name"), str) or not NAME.fullmatch(raw["name"]):
        raise InvalidRequest(f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'",
                             param=f"{where}.name")
    check_schema(raw.get("input_schema"), f"{where}.input_schema")
    if deferred:
        return None
    function = {k: raw[k] for k in ("name", "description", "strict") if raw.get(k) is not None}
    return {"type": "function", "function": {**function, "parameters": raw["input_schema"]}}


def _named(raw: Mapping[str, Any], shown: list[dict[str, Any]], deferred: set[str]) -> str:
    """The tool a `tool` choice names: one shown to the model (a deferred one cannot be)."""
    name, where = raw.get("name"), "tool_choice.name"
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}' is required with tool_choice.type tool, a string",
                             param=where)
    if name in deferred:
        raise InvalidRequest(
            f"'{where}' {name!r} is a deferred tool (defer_loading true): its definition is not "
            "shown to the model, so it cannot be made to call it (this server has no tool "
            "search to load it); offer it without defer_loading to force it", param=where)
    if name not in {tool["function"]["name"] for tool in shown}:
        raise InvalidRequest(f"'{where}' {name!r} names no tool in 'tools'", param=where)
    return name


def tool_choice(body: Mapping[str, Any], chat: dict[str, Any], deferred: set[str]) -> None:
    """`tool_choice` as chat's (`any` = required, `tool` = that function), into `chat`."""
    raw = body.get("tool_choice")
    if raw is None:
        return
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequest("'tool_choice.type' must be auto, any, tool or none",
                             param="tool_choice")
    unknown(raw, frozenset({"type", "name", "disable_parallel_tool_use"}), "tool_choice")
    shown = chat.get("tools") or []
    if kind == "tool":
        chat["tool_choice"] = {"type": "function",
                               "function": {"name": _named(raw, shown, deferred)}}
    elif not shown and kind == "any":
        why = ("needs a tool shown to the model: every tool has defer_loading true, and a "
               "deferred tool is not shown (this server has no tool search to load it); offer "
               "one without it") if deferred else "needs tools"
        raise InvalidRequest(f"'tool_choice' 'any' {why}", param="tool_choice")
    elif not shown:
        return  # auto or none without tools: what a request without tools is
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if fields.boolean(raw, "disable_parallel_tool_use", False) and kind != "none":
        chat["parallel_tool_calls"] = False
