"""A Messages API conversation as chat turns.

`system` is a first system turn; a turn's text blocks are its text parts (joined as chat
joins them); an assistant's `thinking` blocks are its reasoning (a shown thought's signature
accepted, never checked or keyed; an omitted one's, its text empty, gives the thought it
seals) and its `tool_use` blocks its tool calls; each `tool_result` block is a tool turn
answering its `tool_use_id` (`is_error`: its text after "Error: "; the tool_result blocks come
first in their turn, one for each tool_use, as Anthropic requires), and the user's runs of
text are user turns after them. `cache_control` markers are accepted and never keyed.
Anything else (images, documents, server-tool blocks) is a 400 naming the block.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cacheproxy.edge.apis.responses.tools import opened
from cacheproxy.errors import InvalidRequest, Unsupported
from cacheproxy.keys import fields

_TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
_TURN = frozenset({"role", "content"})
_SYSTEM_TURN = _TURN | {"output_config"}  # its effort: `request`


def unknown(block: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    """400 naming the first field of `block` (at `where`) that is set and not `allowed`."""
    for name, value in block.items():
        if name not in allowed and value is not None:
            raise Unsupported(f"'{where}.{name}' is not supported", param=f"{where}.{name}")


def _blocks(raw: object, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of content blocks",
                             param=where)
    for j, block in enumerate(raw):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidRequest(f"'{where}[{j}]' must be a content block with a 'type'",
                                 param=f"{where}[{j}]")
    return raw


def _text(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A text block as a chat text part (cache_control accepted, not keyed)."""
    unknown(block, _TEXT_KEYS, where)
    if block.get("citations"):
        raise Unsupported(f"'{where}.citations' is not supported", param=f"{where}.citations")
    if not isinstance(block.get("text"), str):
        raise InvalidRequest(f"'{where}.text' must be a string", param=f"{where}.text")
    return {"type": "text", "text": block["text"]}


def texts(raw: object, where: str) -> str | list[dict[str, Any]]:
    """A string, or text blocks as chat text parts (joined as chat joins them)."""
    if isinstance(raw, str):
        return raw
    out = []
    for j, block in enumerate(_blocks(raw, where)):
        if block["type"] == "tool_reference":
            raise Unsupported(f"'{where}[{j}].type' 'tool_reference': this server has no tool "
                              "search to load deferred tools (with Claude Code, set "
                              "ENABLE_TOOL_SEARCH=false)", param=f"{where}[{j}].type")
        if block["type"] != "text":
            raise Unsupported(f"'{where}[{j}].type' {block['type']!r}: only text blocks are "
                              "supported here (the model reads text only)",
                              param=f"{where}[{j}].type")
        out.append(_text(block, f"{where}[{j}]"))
    return out


def _assistant(raw: object, where: str, seen: set[str]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    calls, thought = [], ""
    for j, block in enumerate(_blocks(raw, where)):
        at, kind = f"{where}[{j}]", block["type"]
        if kind == "text":
            parts.append(_text(block, at))
        elif kind == "thinking":
            thought += _thought(block, at)
        elif kind == "tool_use":
            calls.append(_tool_use(block, at, seen))
        else:
            raise Unsupported(f"'{at}.type' {kind!r} is not supported in an assistant turn "
                              "(text, thinking, tool_use)", param=f"{at}.type")
    turn: dict[str, Any] = {"role": "assistant", "content": parts or None}
    if calls:
        turn["tool_calls"] = calls
    if thought:
        turn["reasoning_content"] = thought
    return turn


SHOWN_SIGNATURE = "cacheproxy-"  # what the renderer signs a shown thought with


def _thought(block: Mapping[str, Any], where: str) -> str:
    """A thinking block's thought: its text, or (omitted, its text empty) the thought its
    signature seals, so the history is the one the model wrote and keys as if shown."""
    unknown(block, frozenset({"type", "thinking", "signature"}), where)
    if not isinstance(block.get("thinking"), str):
        raise InvalidRequest(f"'{where}.thinking' must be a string", param=f"{where}.thinking")
    signature = block.get("signature")
    if block["thinking"] or signature in (None, "") or \
            (isinstance(signature, str) and signature.startswith(SHOWN_SIGNATURE)):
        # A shown thought's signature is accepted, never keyed; so is an empty thought under
        # one, as this server omitted thoughts before it sealed them (a conversation begun
        # then goes on, its lost thoughts empty, as it keyed then).
        return str(block["thinking"])
    thought = opened(block["signature"])
    if thought is None:
        raise InvalidRequest(f"'{where}.signature' was not written by this server, which "
                             "cannot read another's omitted thinking: send the thought as the "
                             "block's 'thinking' instead", param=f"{where}.signature")
    return thought


def _tool_use(block: Mapping[str, Any], where: str, seen: set[str]) -> dict[str, Any]:
    unknown(block, frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
             where)
    if block.get("caller") not in (None, {"type": "direct"}):
        raise Unsupported(f"'{where}.caller' other than direct is not supported",
                          param=f"{where}.caller")
    if not isinstance(block.get("input"), dict):
        raise InvalidRequest(f"'{where}.input' must be an object", param=f"{where}.input")
    call_id = block.get("id")
    if not isinstance(call_id, str) or not call_id or call_id in seen:
        raise InvalidRequest(f"'{where}.id' must be a string no other tool_use block has",
                             param=f"{where}.id")
    if not isinstance(block.get("name"), str):
        raise InvalidRequest(f"'{where}.name' must be a string", param=f"{where}.name")
    seen.add(call_id)
    return {"id": call_id, "type": "function",
            "function": {"name": block.get("name"), "arguments": block["input"]}}


def _user(raw: object, where: str, seen: set[str], answered: set[str]
          ) -> list[dict[str, Any]]:
    """A user turn's blocks: each tool_result a tool turn, each run of text a user turn.
    As in Anthropic's API, the tool_result blocks come first and answer a call once each."""
    out: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(raw, where)):
        at, kind = f"{where}[{j}]", block["type"]
        if kind == "tool_result" and out and out[-1]["role"] == "user":
            raise InvalidRequest(f"'{at}' is a tool_result after text: in a user turn the "
                                 "tool_result blocks come first, before any text", param=at)
        if kind == "tool_result":
            out.append(_tool_result(block, at, seen, answered))
        elif kind == "text":
            if not out or out[-1]["role"] != "user":
                out.append({"role": "user", "content": []})
            out[-1]["content"].append(_text(block, at))
        else:
            raise Unsupported(f"'{at}.type' {kind!r} is not supported: the model reads "
                              "text (text and tool_result blocks)", param=f"{at}.type")
    if not out:
        raise InvalidRequest(f"'{where}' must not be empty", param=where)
    return out


def _tool_result(block: Mapping[str, Any], where: str, seen: set[str], answered: set[str]
                 ) -> dict[str, Any]:
    unknown(block, frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
            where)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise InvalidRequest(f"'{where}.tool_use_id' must be the string id of an earlier "
                             "tool_use block", param=f"{where}.tool_use_id")
    if call_id not in seen:
        raise InvalidRequest(f"'{where}.tool_use_id' answers no earlier tool_use block",
                             param=f"{where}.tool_use_id")
    if call_id in answered:
        raise InvalidRequest(f"'{where}.tool_use_id' {call_id!r} is answered twice: each "
                             "tool_use has a single tool_result", param=f"{where}.tool_use_id")
    answered.add(call_id)
    content = block.get("content")
    joined = "" if content is None else texts(content, f"{where}.content")
    text = joined if isinstance(joined, str) else "".join(p["text"] for p in joined)
    if fields.boolean(block, "is_error", False):
        text = f"Error: {text}"  # the model is told the tool failed, in the tool's turn
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}


def turns(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of `system` and `messages`."""
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": texts(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    seen: set[str] = set()  # the ids of the tool_use blocks so far
    answered: set[str] = set()  # the ids of those a tool_result block answered
    for i, turn in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        role, content = turn.get("role"), turn.get("content")
        unknown(turn, _SYSTEM_TURN if role == "system" else _TURN, where)
        if role not in ("user", "assistant", "system"):
            raise InvalidRequest(f"'{where}.role' must be user, assistant or system",
                                 param=f"{where}.role")
        if isinstance(content, str) or role == "system":
            out.append({"role": role, "content": texts(content, f"{where}.content")})
        elif role == "assistant":
            out.append(_assistant(content, f"{where}.content", seen))
        else:
            out.extend(_user(content, f"{where}.content", seen, answered))
    if raw[-1].get("role") == "assistant":
        last = f"messages[{len(raw) - 1}]"
        raise InvalidRequest(f"'{last}' is an assistant turn to continue (a prefill): this "
                             "server does not continue a turn; end with a user turn",
                             param=last)
    return out
