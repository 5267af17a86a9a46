"""The stored record: versioned msgpack with a checksum. The only serializer of the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from cacheproxy.keys.margin import Margin

MAGIC = b"CPR"
RECORD_VERSION = 2  # 2: chunks carry reasoning and tool calls
_HEADER = len(MAGIC) + 1 + 8


class CorruptRecord(Exception):
    """Bytes that do not decode to a valid record: treated as a miss and deleted."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and its top alternatives."""

    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallOut:
    """A tool call the model made: its place among the answer's calls, the function and the
    arguments as JSON text. Its id is not stored: it is derived from the key and `index`."""

    index: int
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed piece as generated: its answer text, reasoning text and completed tool
    calls, and the tokens that produced it."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    reasoning: str = ""
    tool_calls: tuple[ToolCallOut, ...] = ()


@dataclass(frozen=True, slots=True)
class Output:
    """A finished generation."""

    chunks: tuple[Chunk, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    # The stop sequence that ended it ("": none did). Not part of `same_answer`: it follows
    # from the text and the request, and records stored before it was kept have none.
    stop: str = ""
    # Measured by the in-process runner as it generates; kept in the record's provenance
    # (a decoded record's output has none: `margin.from_provenance` reads it).
    margin: Margin | None = None

    @property
    def text(self) -> str:
        """The whole completion text."""
        return "".join(c.text for c in self.chunks)

    @property
    def token_ids(self) -> list[int]:
        """Every generated token id, in order."""
        return [t for c in self.chunks for t in c.tokens]

    @property
    def reasoning(self) -> str:
        """The whole reasoning text (empty when the model did not think aloud)."""
        return "".join(c.reasoning for c in self.chunks)

    @property
    def tool_calls(self) -> tuple[ToolCallOut, ...]:
        """Every tool call, in order."""
        return tuple(call for c in self.chunks for call in c.tool_calls)


FINISHED = frozenset({"stop", "length", "tool_calls"})
"""Finish reasons of a generation that ended normally (only these are stored)."""


def same_answer(a: Output, b: Output) -> bool:
    """Whether two outputs are the same answer: tokens, text, reasoning, calls, finish."""
    return (a.token_ids == b.token_ids and a.text == b.text and a.reasoning == b.reasoning
            and a.tool_calls == b.tool_calls and a.finish_reason == b.finish_reason)


@dataclass(frozen=True, slots=True)
class Record:
    """What the store keeps for one key: request, output, provenance."""

    request: dict[str, Any]
    output: Output
    provenance: dict[str, Any] = field(default_factory=dict)


def _chunk_wire(c: Chunk) -> list[Any]:
    lps = [[lp.token, lp.text, lp.logprob, [list(t) for t in lp.top]] for lp in c.logprobs]
    calls = [[call.index, call.name, call.arguments] for call in c.tool_calls]
    return [c.text, list(c.tokens), lps, c.reasoning, calls]


def _typed(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise TypeError(f"{what} has the wrong type {type(value).__name__}")
    return value


def _chunk(w: list[Any]) -> Chunk:
    text, tokens, lps, reasoning, calls = w
    _typed(text, str, "chunk text")
    _typed(reasoning, str, "chunk reasoning")
    for t in _typed(tokens, list, "chunk tokens"):
        _typed(t, int, "token id")
    logprobs = tuple(
        TokenLogprob(t, s, lp, tuple((a, b, c) for a, b, c in top)) for t, s, lp, top in lps
    )
    tool_calls = tuple(ToolCallOut(_typed(i, int, "call index"), _typed(n, str, "call name"),
                                   _typed(a, str, "call arguments")) for i, n, a in calls)
    return Chunk(text, tuple(tokens), logprobs, reasoning, tool_calls)


def encode(record: Record) -> bytes:
    """Record -> bytes: magic, version, xxh3_64 checksum of the payload, msgpack payload."""
    out = record.output
    output = {
        "chunks": [_chunk_wire(c) for c in out.chunks],
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
    }
    if out.stop:  # (only then: a record without one has the bytes it always had)
        output["stop"] = out.stop
    payload = msgpack.packb({"request": record.request, "output": output,
                             "provenance": record.provenance}, use_bin_type=True)
    return MAGIC + bytes([RECORD_VERSION]) + xxhash.xxh3_64_digest(payload) + payload


def decode(data: bytes) -> Record:
    """bytes -> Record; anything wrong raises CorruptRecord."""
    if len(data) < _HEADER or data[: len(MAGIC)] != MAGIC:
        raise CorruptRecord("bad magic")
    if data[len(MAGIC)] != RECORD_VERSION:
        raise CorruptRecord(f"unknown record version {data[len(MAGIC)]}")
    payload = data[_HEADER:]
    if xxhash.xxh3_64_digest(payload) != data[len(MAGIC) + 1 : _HEADER]:
        raise CorruptRecord("checksum mismatch")
    try:
        raw = _typed(msgpack.unpackb(payload, raw=False, strict_map_key=False), dict, "record")
        o = _typed(raw["output"], dict, "output")
        output = Output(
            chunks=tuple(_chunk(c) for c in _typed(o["chunks"], list, "chunks")),
            finish_reason=_typed(o["finish_reason"], str, "finish_reason"),
            prompt_tokens=_typed(o["prompt_tokens"], int, "prompt_tokens"),
            completion_tokens=_typed(o["completion_tokens"], int, "completion_tokens"),
            stop=_typed(o.get("stop", ""), str, "stop"),
        )
        request = _typed(raw["request"], dict, "request")
        provenance = _typed(raw["provenance"], dict, "provenance")
        return Record(request=request, output=output, provenance=provenance)
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptRecord(f"undecodable payload: {exc}") from exc


def record_view(key: str, record: Record) -> dict[str, Any]:
    """A record as plain JSON-able data."""
    o = record.output
    return {
        "key": key,
        "request": record.request,
        "output": {
            "text": o.text,
            "finish_reason": o.finish_reason,
            "stop": o.stop or None,
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "token_ids": o.token_ids,
            "chunks": [c.text for c in o.chunks],
            "reasoning": o.reasoning or None,
            "tool_calls": [{"index": c.index, "name": c.name, "arguments": c.arguments}
                           for c in o.tool_calls] or None,
            "logprobs": [[lp.token, lp.logprob] for c in o.chunks for lp in c.logprobs] or None,
        },
        "provenance": record.provenance,
    }


META_MAGIC = b"CPM"


def encode_meta(value: dict[str, Any]) -> bytes:
    """Small metadata records (the namespace registry): magic, checksum, msgpack."""
    payload = msgpack.packb(value, use_bin_type=True)
    return META_MAGIC + bytes([RECORD_VERSION]) + xxhash.xxh3_64_digest(payload) + payload


def decode_meta(data: bytes) -> dict[str, Any]:
    """Inverse of encode_meta; raises CorruptRecord."""
    if data[: len(META_MAGIC)] != META_MAGIC or len(data) < _HEADER:
        raise CorruptRecord("bad metadata magic")
    payload = data[_HEADER:]
    if xxhash.xxh3_64_digest(payload) != data[len(META_MAGIC) + 1 : _HEADER]:
        raise CorruptRecord("metadata checksum mismatch")
    try:
        value = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CorruptRecord(f"undecodable metadata: {exc}") from exc
    return _typed(value, dict, "metadata")  # type: ignore[no-any-return]
