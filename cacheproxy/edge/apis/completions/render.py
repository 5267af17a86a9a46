"""Text completion shapes: the `text_completion` object, and its stream of chunks."""

from __future__ import annotations

from typing import Any

from cacheproxy.edge.apis.frame import (
    DONE,
    Frame,
    each_choice,
    sse,
    stream_chunk,
    usage,
    usage_chunk,
)
from cacheproxy.errors import ProxyError
from cacheproxy.keys.codec import Chunk, Output, TokenLogprob

_OBJECT = "text_completion"  # of the whole body and of each stream chunk


def _logprobs(lps: tuple[TokenLogprob, ...], offset: int) -> dict[str, Any]:
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
    """A whole (non-stream) text completion."""
    lps = _logprobs(tuple(lp for c in output.chunks for lp in c.logprobs), 0) \
        if frame.logprobs else None
    choices = [{"index": i, "text": output.text, "logprobs": lps,
                "finish_reason": output.finish_reason} for i in range(frame.delivery.n)]
    return {**frame.head(_OBJECT), "choices": choices,
            "usage": usage(output, frame.cached, frame.reused)}


class CompletionStream:
    """The server-sent events of one text completion, chunk by chunk."""

    done = DONE

    def __init__(self, frame: Frame) -> None:
        self._frame = frame
        self._offset = 0  # of the next chunk's text in the answer (its logprobs' offsets)

    def start(self) -> bytes:
        """Nothing: a text completion's first chunk is its first text."""
        return b""

    def chunk(self, chunk: Chunk) -> bytes:
        """One generated piece; nothing for a piece with nothing to show."""
        if not chunk.text and not chunk.reasoning and not chunk.tool_calls:
            return b""
        frame = self._frame
        lp = _logprobs(chunk.logprobs, self._offset) if frame.logprobs else None
        self._offset += len(chunk.text)
        return sse([stream_chunk(frame, _OBJECT,
                                 each_choice(frame, {"text": chunk.text, "logprobs": lp}))])

    def error(self, error: ProxyError) -> bytes:
        """A failure after the stream began, as the error object."""
        return sse([error.body()])

    def end(self, output: Output) -> bytes:
        """The finish reason, and usage when asked."""
        frame = self._frame
        closing = {"text": "", "logprobs": None}
        out = [stream_chunk(frame, _OBJECT, each_choice(frame, closing, output.finish_reason))]
        if frame.delivery.include_usage:
            out.append(usage_chunk(frame, _OBJECT, output))
        return sse(out)
