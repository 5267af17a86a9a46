"""OpenAI response shapes for chat and text completions, whole or as stream chunks."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from cacheproxy.errors import ProxyError
from cacheproxy.keys.canonical import Delivery, Endpoint, Route
from cacheproxy.keys.codec import Chunk, Output, TokenLogprob, ToolCallOut


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
    key: str = ""  # the cache key: tool-call ids are derived from it
    reused: int = 0  # prompt tokens a generation's prefill took from a saved state

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

    def __init__(self, heads: Mapping[Route, str]) -> None:
        prefix = os.urandom(6).hex()
        self._heads = {route: head + prefix for route, head in heads.items()}
        self._counter = itertools.count()

    def next(self, route: Route) -> str:
        """The API's head (`chatcmpl-`, `resp_`, `msg_`...), a prefix and a counter."""
        return f"{self._heads[route]}{next(self._counter):012x}"


def sse(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events, one `data:` line each."""
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


DONE = b"data: [DONE]\n\n"


class ChatStream:
    """The server-sent events of one chat or text completion, chunk by chunk."""

    done = DONE

    def __init__(self, frame: Frame) -> None:
        self._frame = frame
        self._offset = 0  # of the next chunk's text in the answer (text logprobs)

    def start(self) -> bytes:
        """The opening chunk (chat sends the assistant role first)."""
        return sse(stream_start(self._frame))

    def chunk(self, chunk: Chunk) -> bytes:
        """One generated piece; nothing for a piece with nothing to show."""
        event = stream_chunk(self._frame, chunk, self._offset)
        self._offset += len(chunk.text)
        return b"" if event is None else sse([event])

    def error(self, error: ProxyError) -> bytes:
        """A failure after the stream began, as the error object."""
        return sse([error.body()])

    def end(self, output: Output) -> bytes:
        """The finish reason, and usage when asked."""
        return sse(stream_end(self._frame, output))


def whole_stream(frame: Frame, output: Output) -> bytes:
    """Every event of a stream at once (a hit replays the stored chunk boundaries)."""
    stream = ChatStream(frame)
    return stream.start() + b"".join(stream.chunk(c) for c in output.chunks) + \
        stream.end(output) + DONE


def usage(output: Output, cached: bool, reused: int = 0) -> dict[str, Any]:
    """Token counts of the stored generation; on a hit the whole prompt was cached, on a
    generation what its prefill reused."""
    p, c = output.prompt_tokens, output.completion_tokens
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": p if cached else reused},
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


def call_id(key: str, choice: int, index: int) -> str:
    """A tool call's id, the same on every answer of one key: a HIT, a regeneration, a
    replay by `verify` (a random id would make every one of them another answer)."""
    return "call_" + xxhash.xxh3_64_hexdigest(f"{key}/{choice}/{index}".encode())


def _calls(frame: Frame, calls: tuple[ToolCallOut, ...], choice: int) -> dict[str, Any]:
    """`tool_calls` (or the legacy `function_call`: its first call) of a message or delta."""
    if frame.delivery.legacy_functions:
        return {"function_call": {"name": calls[0].name, "arguments": calls[0].arguments}}
    return {"tool_calls": [
        {"index": c.index, "id": call_id(frame.key, choice, c.index), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}


def _reasoning(text: str) -> dict[str, str]:
    # `reasoning` as mlx_lm.server sends it; `reasoning_content` as DeepSeek and vLLM do,
    # which the openai-agents chat model reads first.
    return {"reasoning": text, "reasoning_content": text} if text else {}


def finish_reason(frame: Frame, output: Output) -> str:
    """The output's finish reason as the client's API names it."""
    if output.finish_reason == "tool_calls" and frame.delivery.legacy_functions:
        return "function_call"
    return output.finish_reason


def _message(frame: Frame, output: Output, choice: int) -> dict[str, Any]:
    text, calls = output.text, output.tool_calls
    message: dict[str, Any] = {"role": "assistant",
                               "content": text if text or not calls else None}
    message.update(_reasoning(output.reasoning))
    if calls:
        message.update(_calls(frame, calls, choice))
        if not frame.delivery.legacy_functions:
            for call in message["tool_calls"]:
                del call["index"]  # a whole message lists its calls in order
    return message


def body(frame: Frame, output: Output) -> dict[str, Any]:
    """A whole (non-stream) response."""
    text = output.text
    lps = tuple(lp for c in output.chunks for lp in c.logprobs)
    choices = []
    for i in range(frame.delivery.n):
        if frame.endpoint == "chat":
            choice: dict[str, Any] = {
                "index": i,
                "message": _message(frame, output, i),
                "logprobs": _chat_logprobs(lps) if frame.logprobs else None,
            }
        else:
            choice = {"index": i, "text": text,
                      "logprobs": _text_logprobs(lps, 0) if frame.logprobs else None}
        choice["finish_reason"] = finish_reason(frame, output)
        choices.append(choice)
    return {**frame.head(frame.object), "choices": choices,
            "usage": usage(output, frame.cached, frame.reused)}


def stream_start(frame: Frame) -> list[dict[str, Any]]:
    """The opening chunk (chat sends the assistant role first)."""
    if frame.endpoint != "chat":
        return []
    delta = {"role": "assistant", "content": ""}
    return [_chunk(frame, _each_choice(frame, {"delta": delta, "logprobs": None}))]


def stream_chunk(frame: Frame, chunk: Chunk, offset: int) -> dict[str, Any] | None:
    """One generated piece as a stream chunk; pieces with nothing to show are not sent."""
    if not chunk.text and not chunk.reasoning and not chunk.tool_calls:
        return None
    if frame.endpoint == "chat":
        lp = _chat_logprobs(chunk.logprobs) if frame.logprobs else None
        parts = []
        for i in range(frame.delivery.n):
            delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
            delta.update(_reasoning(chunk.reasoning))
            if chunk.tool_calls:
                delta.update(_calls(frame, chunk.tool_calls, i))
            parts.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": None})
        return _chunk(frame, parts)
    lp = _text_logprobs(chunk.logprobs, offset) if frame.logprobs else None
    return _chunk(frame, _each_choice(frame, {"text": chunk.text, "logprobs": lp}))


def stream_end(frame: Frame, output: Output) -> list[dict[str, Any]]:
    """The closing chunk with the finish reason, and usage when asked."""
    closing: dict[str, Any] = {"delta": {}} if frame.endpoint == "chat" else {"text": ""}
    finish = finish_reason(frame, output)
    out = [_chunk(frame, _each_choice(frame, {**closing, "logprobs": None}, finish))]
    if frame.delivery.include_usage:
        obj = "chat.completion.chunk" if frame.endpoint == "chat" else "text_completion"
        out.append({**frame.head(obj), "choices": [],
                    "usage": usage(output, frame.cached, frame.reused)})
    return out


def _each_choice(frame: Frame, part: dict[str, Any], finish: str | None = None
                 ) -> list[dict[str, Any]]:
    return [{"index": i, **part, "finish_reason": finish} for i in range(frame.delivery.n)]


def _chunk(frame: Frame, choices: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if frame.endpoint == "chat" else "text_completion"
    out = {**frame.head(obj), "choices": choices}
    if frame.delivery.include_usage:
        out["usage"] = None
    return out
