"""Messages API shapes: the `message` object, and its stream of typed events.

A generation is rendered as content blocks in the order it produced them: each run of
thought a `thinking` block, each run of text a `text` block, each tool call a `tool_use`
block. Tool-use ids and shown thoughts' signatures are derived from the cache key (as chat's
call ids are), so a HIT and a regeneration give the same bytes; an omitted thought (display
"omitted": its text empty) has the thought sealed as its signature, for the history to give
back; the message id is the response's own. A stream is Anthropic's events
(`message_start`, `ping`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`), one stored or live chunk at a time, so a streamed HIT has the events and
boundaries of the generation it replays.
"""

from __future__ import annotations

from typing import Any

import orjson
import xxhash

from cacheproxy.edge.apis.frame import Frame
from cacheproxy.edge.apis.messages.errors import error_body
from cacheproxy.edge.apis.messages.turns import SHOWN_SIGNATURE
from cacheproxy.edge.apis.responses.tools import seal
from cacheproxy.errors import ProxyError
from cacheproxy.keys.codec import Chunk, Output, ToolCallOut

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def tool_use_id(frame: Frame, index: int) -> str:
    """A call's id: from the key and its index, the same hash as chat's `call_` id."""
    return "toolu_" + xxhash.xxh3_64_hexdigest(f"{frame.key}/0/{index}".encode())


def _signature(frame: Frame, index: int, thought: str, omitted: bool) -> str:
    """An omitted thought's signature is the thought sealed (the client sends it back in the
    history and `turns` unseals it); a shown one's, a stable token clients pass back unread
    (not a proof of origin as Anthropic's are)."""
    if omitted:
        return seal(thought)
    return SHOWN_SIGNATURE + xxhash.xxh3_64_hexdigest(f"{frame.key}/thinking/{index}".encode())


def _omitted(frame: Frame) -> bool:
    return bool(frame.delivery.echo) and bool(orjson.loads(frame.delivery.echo)
                                              .get("omit_thinking"))


def _tool_use(frame: Frame, call: ToolCallOut, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(frame, call.index), "name": call.name,
            "input": arguments}


def call_input(call: ToolCallOut) -> dict[str, Any] | None:
    """A call's input, None when its arguments are not a JSON object: tool_use.input must
    be one (the runner makes no such call; an entry stored before it checked may hold one)."""
    try:
        value = orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def call_text(call: ToolCallOut) -> str:
    """A call that cannot be a tool_use, as the text of the call the model wrote."""
    try:
        arguments: Any = orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        arguments = call.arguments
    return orjson.dumps({"name": call.name, "arguments": arguments}).decode()


def blocks(frame: Frame, output: Output) -> list[dict[str, Any]]:
    """The content blocks of a finished generation, as its stream ends them."""
    out: list[dict[str, Any]] = []
    for chunk in output.chunks:
        for kind, text in (("thinking", chunk.reasoning), ("text", chunk.text)):
            if text and out and out[-1]["type"] == kind:
                out[-1][kind] += text
            elif text:
                out.append({"type": kind, kind: text})
        for call in chunk.tool_calls:
            if (arguments := call_input(call)) is not None:
                out.append(_tool_use(frame, call, arguments))
            elif out and out[-1]["type"] == "text":
                out[-1]["text"] += call_text(call)
            else:
                out.append({"type": "text", "text": call_text(call)})
    omitted = _omitted(frame)
    for index, block in enumerate(out):
        if block["type"] == "thinking":
            block["signature"] = _signature(frame, index, block["thinking"], omitted)
            block["thinking"] = "" if omitted else block["thinking"]
    return out


def stop(output: Output) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation (tool_use only with a tool_use
    block to answer)."""
    if output.finish_reason == "stop" and output.stop:
        return "stop_sequence", output.stop
    if output.finish_reason == "tool_calls" and not any(
            call_input(call) is not None for c in output.chunks for call in c.tool_calls):
        return "end_turn", None
    return _STOP_REASONS.get(output.finish_reason, "end_turn"), None


def usage(frame: Frame, output: Output) -> dict[str, Any]:
    """Token counts as Anthropic splits them: the prompt tokens read from a cache (all of
    them on a HIT, those a saved prefix state spared on a generation) apart from the rest."""
    read = output.prompt_tokens if frame.cached else frame.reused
    return {"input_tokens": output.prompt_tokens - read, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": read, "output_tokens": output.completion_tokens,
            "service_tier": "standard"}


def message(frame: Frame, output: Output | None) -> dict[str, Any]:
    """The message object; `output` None at the start of a stream."""
    reason, sequence = stop(output) if output is not None else (None, None)
    counts = usage(frame, output) if output is not None else {
        "input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
        "output_tokens": 0, "service_tier": "standard"}
    return {"id": frame.id, "type": "message", "role": "assistant", "model": frame.model,
            "content": blocks(frame, output) if output is not None else [],
            "stop_reason": reason, "stop_sequence": sequence, "usage": counts}


def body(frame: Frame, output: Output) -> dict[str, Any]:
    """A whole (non-stream) answer."""
    return message(frame, output)


def _event(kind: str, fields: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + \
        orjson.dumps({"type": kind, **fields}) + b"\n\n"


class MessagesStream:
    """The events of one message, rendered chunk by chunk (live, or from a stored answer)."""

    done = b""  # message_stop is the last event

    def __init__(self, frame: Frame) -> None:
        self._frame = frame
        self._omitted = _omitted(frame)
        self._blocks = 0  # content blocks opened so far
        self._open = ""  # "thinking" | "text" | "": the kind of the open block
        self._thought = ""  # the open thinking block's thought (its signature seals it)

    def start(self) -> bytes:
        """message_start, then a ping (as Anthropic sends them)."""
        return _event("message_start", {"message": message(self._frame, None)}) + \
            _event("ping", {})

    def chunk(self, chunk: Chunk) -> bytes:
        """The events of one stored or live chunk."""
        out = b""
        if chunk.reasoning:
            out += self._delta("thinking", chunk.reasoning)
        if chunk.text:
            out += self._delta("text", chunk.text)
        for call in chunk.tool_calls:
            if call_input(call) is None:
                out += self._delta("text", call_text(call))
            else:
                out += self._close() + self._call(call)
        return out

    def error(self, error: ProxyError) -> bytes:
        """A failure after the stream began: an `error` event."""
        return _event("error", {"error": error_body(error)["error"]})

    def end(self, output: Output) -> bytes:
        """Close the open block; message_delta (stop reason, usage), message_stop."""
        reason, sequence = stop(output)
        return self._close() + _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(self._frame, output)}) + _event("message_stop", {})

    def _delta(self, kind: str, text: str) -> bytes:
        out = b""
        if self._open != kind:
            out += self._close() + self._start(kind)
        if kind == "thinking":
            self._thought += text
        if kind == "thinking" and self._omitted:
            return out
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return out + _event("content_block_delta", {"index": self._blocks - 1, "delta": delta})

    def _start(self, kind: str) -> bytes:
        self._open, self._thought, index = kind, "", self._blocks
        self._blocks += 1
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
            else {"type": "text", "text": ""}
        return _event("content_block_start", {"index": index, "content_block": block})

    def _close(self) -> bytes:
        if not self._open:
            return b""
        index, out = self._blocks - 1, b""
        if self._open == "thinking":
            out = _event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta",
                "signature": _signature(self._frame, index, self._thought, self._omitted)}})
        self._open = ""
        return out + _event("content_block_stop", {"index": index})

    def _call(self, call: ToolCallOut) -> bytes:
        index = self._blocks
        self._blocks += 1
        return (_event("content_block_start", {"index": index,
                                               "content_block": _tool_use(self._frame, call, {})})
                + _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": call.arguments}})
                + _event("content_block_stop", {"index": index}))
