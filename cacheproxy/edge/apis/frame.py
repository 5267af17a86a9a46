"""What the APIs' renderings share: the frame of one response, response ids, the tool-call
ids derived from the key, and the OpenAI stream framing of chat and text completions."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from cacheproxy.keys.canonical import Delivery, Route
from cacheproxy.keys.codec import Output


@dataclass(frozen=True, slots=True)
class Frame:
    """Fields every chunk and body of one response shares."""

    id: str
    created: int
    model: str
    fingerprint: str
    delivery: Delivery
    logprobs: bool
    cached: bool
    key: str = ""  # the cache key: tool-call ids are derived from it
    reused: int = 0  # prompt tokens a generation's prefill took from a saved state

    def head(self, obj: str) -> dict[str, Any]:
        """The leading fields of an OpenAI completion object named `obj`."""
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


def call_id(key: str, choice: int, index: int) -> str:
    """A tool call's id, the same on every answer of one key: a HIT, a regeneration, a
    replay by `verify` (a random id would make every one of them another answer)."""
    return "call_" + xxhash.xxh3_64_hexdigest(f"{key}/{choice}/{index}".encode())


def sse(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events, one `data:` line each."""
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


DONE = b"data: [DONE]\n\n"


def usage(output: Output, cached: bool, reused: int = 0) -> dict[str, Any]:
    """Token counts of the stored generation (chat and text completions); on a hit the whole
    prompt was cached, on a generation what its prefill reused."""
    p, c = output.prompt_tokens, output.completion_tokens
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": p if cached else reused},
    }


def each_choice(frame: Frame, part: dict[str, Any], finish: str | None = None
                ) -> list[dict[str, Any]]:
    """The same part in every choice (`n` choices of one greedy answer)."""
    return [{"index": i, **part, "finish_reason": finish} for i in range(frame.delivery.n)]


def stream_chunk(frame: Frame, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One OpenAI stream chunk named `obj` (with `usage: null` when usage is asked)."""
    out = {**frame.head(obj), "choices": choices}
    if frame.delivery.include_usage:
        out["usage"] = None
    return out


def usage_chunk(frame: Frame, obj: str, output: Output) -> dict[str, Any]:
    """The closing chunk of `stream_options.include_usage`."""
    return {**frame.head(obj), "choices": [],
            "usage": usage(output, frame.cached, frame.reused)}
