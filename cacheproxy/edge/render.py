"""OpenAI response shapes for chat and text completions, whole or as stream chunks."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import orjson

from cacheproxy.keys.canonical import Delivery, Endpoint
from cacheproxy.keys.codec import Chunk, Output, TokenLogprob


@dataclass(frozen=True, slots=True)
class Frame:
    """Fields every chunk and body of one response shares."""

    id: str
    created: int
    model: str
    fingerprint: str
    endpoint: Endpoint
    delivery: Delivery
    logprobs: bool
    cached: bool

    @property
    def object(self) -> str:
        """The OpenAI object name of a whole response."""
        return "chat.completion" if self.endpoint == "chat" else "text_completion"

    def head(self, obj: str) -> dict[str, Any]:
        """The common leading fields."""
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }


class ResponseIds:
    """Unique response ids without a uuid4 per response: a random prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count()

    def next(self, endpoint: Endpoint) -> str:
        """`chatcmpl-…` or `cmpl-…`."""
        head = "chatcmpl-" if endpoint == "chat" else "cmpl-"
        return f"{head}{self._prefix}{next(self._counter):012x}"


def sse(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events, one `data:` line each."""
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


DONE = b"data: [DONE]\n\n"


def whole_stream(frame: Frame, output: Output) -> bytes:
    """Every event of a stream at once (a hit replays the stored chunk boundaries)."""
    events = stream_start(frame)
    offset = 0
    for chunk in output.chunks:
        if (event := stream_chunk(frame, chunk, offset)) is not None:
            events.append(event)
        offset += len(chunk.text)
    return sse([*events, *stream_end(frame, output)]) + DONE


def usage(output: Output, cached: bool) -> dict[str, Any]:
    """Token counts of the stored generation; on a hit the whole prompt was cached."""
    p, c = output.prompt_tokens, output.completion_tokens
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": p if cached else 0},
    }


def _chat_logprobs(lps: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    def one(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [
        {**one(x.text, x.logprob), "top_logprobs": [one(t, v) for _, t, v in x.top]}
        for x in lps
    ]}


def _text_logprobs(lps: tuple[TokenLogprob, ...], offset: int) -> dict[str, Any]:
    offsets = []
    for x in lps:
        offsets.append(offset)
        offset += len(x.text)
    return {
        "tokens": [x.text for x in lps],
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{t: v for _, t, v in x.top} for x in lps],
        "text_offset": offsets,
    }


def body(frame: Frame, output: Output) -> dict[str, Any]:
    """A whole (non-stream) response."""
    text = output.text
    lps = tuple(lp for c in output.chunks for lp in c.logprobs)
    choices = []
    for i in range(frame.delivery.n):
        if frame.endpoint == "chat":
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": _chat_logprobs(lps) if frame.logprobs else None,
            }
        else:
            choice = {"index": i, "text": text,
                      "logprobs": _text_logprobs(lps, 0) if frame.logprobs else None}
        choice["finish_reason"] = output.finish_reason
        choices.append(choice)
    return {**frame.head(frame.object), "choices": choices, "usage": usage(output, frame.cached)}


def stream_start(frame: Frame) -> list[dict[str, Any]]:
    """The opening chunk (chat sends the assistant role first)."""
    if frame.endpoint != "chat":
        return []
    delta = {"role": "assistant", "content": ""}
    return [_chunk(frame, [{"delta": delta, "logprobs": None}])]


def stream_chunk(frame: Frame, chunk: Chunk, offset: int) -> dict[str, Any] | None:
    """One generated piece as a stream chunk; pieces with no text are not sent."""
    if not chunk.text:
        return None
    if frame.endpoint == "chat":
        lp = _chat_logprobs(chunk.logprobs) if frame.logprobs else None
        return _chunk(frame, [{"delta": {"content": chunk.text}, "logprobs": lp}])
    lp = _text_logprobs(chunk.logprobs, offset) if frame.logprobs else None
    return _chunk(frame, [{"text": chunk.text, "logprobs": lp}])


def stream_end(frame: Frame, output: Output) -> list[dict[str, Any]]:
    """The closing chunk with the finish reason, and usage when asked."""
    closing: dict[str, Any] = {"delta": {}} if frame.endpoint == "chat" else {"text": ""}
    out = [_chunk(frame, [{**closing, "logprobs": None}], finish=output.finish_reason)]
    if frame.delivery.include_usage:
        obj = "chat.completion.chunk" if frame.endpoint == "chat" else "text_completion"
        out.append({**frame.head(obj), "choices": [], "usage": usage(output, frame.cached)})
    return out


def _chunk(frame: Frame, parts: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
    obj = "chat.completion.chunk" if frame.endpoint == "chat" else "text_completion"
    choices = [
        {"index": i, **part, "finish_reason": finish}
        for i in range(frame.delivery.n)
        for part in parts
    ]
    out = {**frame.head(obj), "choices": choices}
    if frame.delivery.include_usage:
        out["usage"] = None
    return out
