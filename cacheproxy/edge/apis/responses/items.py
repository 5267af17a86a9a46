"""The keys of a Responses `input` item and of its parts: each applied, passed or refused.

Every key openai's types define for an item this server reads (a message, input or output;
a function call and its output; a reasoning item) and for their parts (text, the thought's
summary and content) falls in one class; any other key is a 400 naming its path
(`input[i].key`, `input[i].content[j].key`), never dropped:

- applied: read into the chat turn (`responses._messages`): a message's `role` and
  `content`, a part's `text`, a call's `call_id`, `name` and `arguments`, an output's
  `call_id` and `output`, a thought's `summary`, `content` or `encrypted_content`;
- passed: what a client echoes back with the history it was given (Codex and openai-agents
  send output items whole): `id`, `status`, a message's `phase`, an output text's
  `annotations` and `logprobs`, a call's `namespace` (the function is offered, and called,
  by its own name), an output's `name` (its call names the function), a part's
  `prompt_cache_breakpoint` (this cache is exact-match). No chat template shows them: their
  type is checked, they are never keyed;
- moot: a `caller` of type `direct` (how every call here is made); one from a program is
  refused (this server runs no programmatic tool calling).

Parts other than text (`input_image`, `input_file`, `refusal`) are refused by type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cacheproxy.errors import InvalidRequest, Unsupported

# The keys of openai's EasyInputMessageParam, Message and ResponseOutputMessageParam;
# ResponseFunctionToolCallParam; FunctionCallOutput; ResponseReasoningItemParam.
ITEM_KEYS = {
    "message": frozenset({"type", "role", "content", "id", "status", "phase"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status",
                                "namespace", "caller"}),
    "function_call_output": frozenset({"type", "call_id", "output", "id", "status", "caller",
                                       "name", "namespace"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}),
}
# Text parts: ResponseInputTextParam (and its ...ContentParam), ResponseOutputTextParam, and
# chat's `text` part; a thought's parts: its Summary and Content.
PART_KEYS = {
    "input_text": frozenset({"type", "text", "prompt_cache_breakpoint"}),
    "output_text": frozenset({"type", "text", "annotations", "logprobs"}),
    "text": frozenset({"type", "text"}),
}
THOUGHT_KEYS = {
    "summary": {"summary_text": frozenset({"type", "text"})},
    "content": {"reasoning_text": frozenset({"type", "text"})},
}
_STATUSES = ("in_progress", "completed", "incomplete")
_PASSED_STRINGS = ("id", "phase", "namespace")
_PASSED_LISTS = ("annotations", "logprobs")


def check(item: Mapping[str, Any], kind: str, where: str) -> None:
    """Refuse a key the item's type does not define; check the passed ones' types."""
    _known(item, ITEM_KEYS[kind], where)
    for name in _PASSED_STRINGS:
        _string_or_null(item, name, where)
    if kind == "function_call_output":
        _string_or_null(item, "name", where)
    status = item.get("status")
    if status is not None and status not in _STATUSES:
        raise InvalidRequest(f"'{where}.status' must be one of {list(_STATUSES)}",
                             param=f"{where}.status")
    if item.get("caller") is not None:
        _caller(item["caller"], f"{where}.caller")


def texts(parts: object, where: str) -> str:
    """The text of a list of text parts (`where` names the list), each checked key by key."""
    if not isinstance(parts, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of text parts",
                             param=where)
    out = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or not isinstance(kind, str) or kind not in PART_KEYS:
            raise Unsupported(f"'{at}' must be a text part (input_text or output_text); "
                              f"{kind!r} parts are not supported", param=f"{at}.type")
        _known(part, PART_KEYS[kind], at)
        for name in _PASSED_LISTS:
            if part.get(name) is not None and not isinstance(part[name], list):
                raise InvalidRequest(f"'{at}.{name}' must be a list", param=f"{at}.{name}")
        breakpoint_ = part.get("prompt_cache_breakpoint")
        if breakpoint_ is not None and not isinstance(breakpoint_, dict):
            raise InvalidRequest(f"'{at}.prompt_cache_breakpoint' must be an object",
                                 param=f"{at}.prompt_cache_breakpoint")
        out.append(_text(part, at))
    return "".join(out)


def thought(item: Mapping[str, Any], where: str) -> str:
    """The text of a reasoning item's `content` (its thought), else of its `summary` (both
    checked part by part, even when the item is sealed)."""
    found = {name: _thought(item, name, where) for name in THOUGHT_KEYS}
    return found["content"] or found["summary"]


def _thought(item: Mapping[str, Any], name: str, where: str) -> str:
    parts, keys = item.get(name) or [], THOUGHT_KEYS[name]
    if not isinstance(parts, list):
        raise InvalidRequest(f"'{where}.{name}' must be a list", param=f"{where}.{name}")
    out = []
    for j, part in enumerate(parts):
        at = f"{where}.{name}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or not isinstance(kind, str) or kind not in keys:
            raise InvalidRequest(f"'{at}.type' must be {next(iter(keys))}",
                                 param=f"{at}.type")
        _known(part, keys[kind], at)
        out.append(_text(part, at))
    return "".join(out)


def _text(part: Mapping[str, Any], at: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"'{at}.text' must be a string", param=f"{at}.text")
    return text


def _known(spec: Mapping[str, Any], keys: frozenset[str], where: str) -> None:
    for name in spec:
        if name not in keys:
            raise Unsupported(f"'{where}.{name}' is not a key this server knows for "
                              f"{spec.get('type')!r}: it is refused rather than ignored",
                              param=f"{where}.{name}")


def _string_or_null(item: Mapping[str, Any], name: str, where: str) -> None:
    if item.get(name) is not None and not isinstance(item[name], str):
        raise InvalidRequest(f"'{where}.{name}' must be a string", param=f"{where}.{name}")


def _caller(raw: object, where: str) -> None:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "program":
        raise Unsupported(f"'{where}' of type program is not supported: this server runs no "
                          "programmatic tool calling", param=where)
    if not isinstance(raw, dict) or kind != "direct":
        raise InvalidRequest(f"'{where}.type' must be direct", param=f"{where}.type")
    _known(raw, frozenset({"type"}), where)
