"""`context_management`: the context edits a Messages request asks for, applied to its turns.

`clear_thinking_20251015` is applied as Anthropic applies it: the thinking blocks of all but
the last `keep` assistant turns that have any are cleared before the prompt is rendered
(`keep`: `{"type": "thinking_turns", "value": N}`, default 1; `"all"` clears none, which is
what Claude Code sends). The edit changes the prompt, so the key is the edited conversation's.
Edits that depend on the prompt's token count (`clear_tool_uses_20250919`) or that summarise
it (`compact_...`) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cacheproxy.edge.apis.messages.turns import unknown
from cacheproxy.errors import InvalidRequest, Unsupported
from cacheproxy.keys import fields

CLEAR_THINKING = "clear_thinking_20251015"
_THOUGHTS = frozenset({"thinking", "redacted_thinking"})


def _keep(raw: object, where: str) -> int | None:
    """The thinking turns kept (None: all of them)."""
    if raw == "all":
        return None
    if raw is None:
        return 1
    if not isinstance(raw, dict) or raw.get("type") != "thinking_turns":
        raise InvalidRequest(f"'{where}.keep' must be \"all\" or a thinking_turns object",
                             param=f"{where}.keep")
    unknown(raw, frozenset({"type", "value"}), f"{where}.keep")
    kept = fields.integer(raw, "value", None, lo=0, hi=2**31)
    if kept is None:
        raise InvalidRequest(f"'{where}.keep.value' is required", param=f"{where}.keep.value")
    return kept


def _thinks(turn: object) -> bool:
    return (isinstance(turn, dict) and turn.get("role") == "assistant"
            and isinstance(turn.get("content"), list)
            and any(isinstance(b, dict) and b.get("type") in _THOUGHTS for b in turn["content"]))


def _cleared(messages: list[Any], keep: int) -> list[Any]:
    """`messages` with the thinking blocks of all but the last `keep` thinking turns removed."""
    thinking = [i for i, turn in enumerate(messages) if _thinks(turn)]
    clear = set(thinking[:max(len(thinking) - keep, 0)])
    return [{**turn, "content": [b for b in turn["content"]
                                 if not (isinstance(b, dict) and b.get("type") in _THOUGHTS)]}
            if i in clear else turn for i, turn in enumerate(messages)]


def edited(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """`body` with its context edits applied to `messages` (as is without any)."""
    raw = fields.obj(body, "context_management")
    if not raw:
        return body
    unknown(raw, frozenset({"edits"}), "context_management")
    edits = raw.get("edits") or []
    if not isinstance(edits, list):
        raise InvalidRequest("'context_management.edits' must be a list",
                             param="context_management.edits")
    messages = body.get("messages")
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        if not isinstance(edit, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        kind = edit.get("type")
        if kind != CLEAR_THINKING:
            raise Unsupported(f"'{where}.type' {kind!r} is not supported: this server applies "
                              f"{CLEAR_THINKING} only (send the turns to keep)",
                              param=f"{where}.type")
        unknown(edit, frozenset({"type", "keep"}), where)
        keep = _keep(edit.get("keep"), where)
        if keep is not None and isinstance(messages, list):
            messages = _cleared(messages, keep)
    return {**body, "messages": messages} if messages is not body.get("messages") else body
