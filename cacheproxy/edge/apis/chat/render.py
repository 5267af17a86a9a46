"""Chat completion shapes: the `chat.completion` object, and its stream of chunks."""

from __future__ import annotations

from typing import Any

from cacheproxy.edge.apis.frame import (
    DONE,
    Frame,
    call_id,
    each_choice,
    sse,
    stream_chunk,
    usage,
    usage_chunk,
)
from cacheproxy.errors import ProxyError
from cacheproxy.keys.codec import Chunk, Output, TokenLogprob, ToolCallOut

_CHUNK = "chat.completion.chunk"


def _logprobs(lps: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    def one(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [
        {**one(x.text, x.logprob), "top_logprobs": [one(t, v) for _, t, v in x.top]}
        for x in lps
    ]}


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
    """The output's finish reason as chat names it (legacy functions: `function_call`)."""
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
    """A whole (non-stream) chat completion."""
    lps = _logprobs(tuple(lp for c in output.chunks for lp in c.logprobs)) \
        if frame.logprobs else None
    finish = finish_reason(frame, output)
    choices = [{"index": i, "message": _message(frame, output, i), "logprobs": lps,
                "finish_reason": finish} for i in range(frame.delivery.n)]
    return {**frame.head("chat.completion"), "choices": choices,
            "usage": usage(output, frame.cached, frame.reused)}


class ChatStream:
    """The server-sent events of one chat completion, chunk by chunk."""

    done = DONE

    def __init__(self, frame: Frame) -> None:
        self._frame = frame

    def start(self) -> bytes:
        """The opening chunk: the assistant role."""
        delta = {"role": "assistant", "content": ""}
        return sse([stream_chunk(self._frame, _CHUNK,
                                 each_choice(self._frame, {"delta": delta, "logprobs": None}))])

    def chunk(self, chunk: Chunk) -> bytes:
        """One generated piece; nothing for a piece with nothing to show."""
        if not chunk.text and not chunk.reasoning and not chunk.tool_calls:
            return b""
        frame = self._frame
        lp = _logprobs(chunk.logprobs) if frame.logprobs else None
        parts = []
        for i in range(frame.delivery.n):
            delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
            delta.update(_reasoning(chunk.reasoning))
            if chunk.tool_calls:
                delta.update(_calls(frame, chunk.tool_calls, i))
            parts.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": None})
        return sse([stream_chunk(frame, _CHUNK, parts)])

    def error(self, error: ProxyError) -> bytes:
        """A failure after the stream began, as the error object."""
        return sse([error.body()])

    def end(self, output: Output) -> bytes:
        """The finish reason, and usage when asked."""
        frame = self._frame
        closing: dict[str, Any] = {"delta": {}, "logprobs": None}
        out = [stream_chunk(frame, _CHUNK,
                            each_choice(frame, closing, finish_reason(frame, output)))]
        if frame.delivery.include_usage:
            out.append(usage_chunk(frame, _CHUNK, output))
        return sse(out)
