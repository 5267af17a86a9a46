"""A stored record as one line of JSON: lossless, readable, checksummed.

The line holds the key, the canonical request, the output (its text, reasoning and tool
calls for a reader, then every chunk as generated: text, token ids, logprobs, reasoning,
calls), the provenance and `checksum`: the xxh3_64 of the record's stored encoding
(`codec.encode`). Reading a line rebuilds the record from its chunks, re-encodes it and
compares: one changed token, one changed character, and the line is refused; the readable
summary must agree with the chunks too. JSON keeps every float exactly (shortest repr) and
every key order, so a record read back encodes to the very bytes it was exported from.
"""

from __future__ import annotations

from typing import Any

import orjson
import xxhash

from cacheproxy.keys import codec


class BadLine(ValueError):
    """A line that is not a valid, untampered record."""


def checksum(record: codec.Record) -> str:
    """The xxh3_64 (hex) of the record's stored encoding."""
    return xxhash.xxh3_64_hexdigest(codec.encode(record))


def to_line(key: str, record: codec.Record) -> bytes:
    """The JSON line of one entry (a newline at the end)."""
    o = record.output
    chunks = [{"text": c.text, "tokens": list(c.tokens),
               "logprobs": [[lp.token, lp.text, lp.logprob, [list(t) for t in lp.top]]
                            for lp in c.logprobs],
               "reasoning": c.reasoning,
               "tool_calls": [[t.index, t.name, t.arguments] for t in c.tool_calls]}
              for c in o.chunks]
    output = {"text": o.text, "reasoning": o.reasoning,
              "tool_calls": [{"index": t.index, "name": t.name, "arguments": t.arguments}
                             for t in o.tool_calls],
              "finish_reason": o.finish_reason, "prompt_tokens": o.prompt_tokens,
              "completion_tokens": o.completion_tokens, "chunks": chunks}
    line = {"key": key, "request": record.request, "output": output,
            "provenance": record.provenance, "checksum": checksum(record)}
    return orjson.dumps(line) + b"\n"


def _chunk(c: dict[str, Any]) -> codec.Chunk:
    logprobs = tuple(codec.TokenLogprob(t, s, lp, tuple((a, b, v) for a, b, v in top))
                     for t, s, lp, top in c["logprobs"])
    calls = tuple(codec.ToolCallOut(i, n, a) for i, n, a in c["tool_calls"])
    return codec.Chunk(c["text"], tuple(c["tokens"]), logprobs, c["reasoning"], calls)


def from_line(data: bytes) -> tuple[str, codec.Record]:
    """(key, record) of one line; BadLine when it is malformed or does not verify."""
    try:
        line = orjson.loads(data)
        o = line["output"]
        output = codec.Output(tuple(_chunk(c) for c in o["chunks"]), o["finish_reason"],
                              o["prompt_tokens"], o["completion_tokens"])
        record = codec.Record(line["request"], output, line["provenance"])
        key, expected = line["key"], line["checksum"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise BadLine(f"not a record line: {type(exc).__name__}: {exc}") from None
    summary = (o.get("text"), o.get("reasoning"),
               [(t.get("index"), t.get("name"), t.get("arguments")) for t in o["tool_calls"]])
    if summary != (output.text, output.reasoning,
                   [(t.index, t.name, t.arguments) for t in output.tool_calls]):
        raise BadLine("the text, reasoning or tool calls disagree with the chunks")
    try:
        actual = checksum(record)
    except (TypeError, ValueError) as exc:
        raise BadLine(f"the record does not encode: {exc}") from None
    if not isinstance(key, str) or actual != expected:
        raise BadLine(f"checksum mismatch: the line says {expected}, its record is {actual}")
    if key.partition("/")[0] != record.provenance.get("fingerprint"):
        raise BadLine("the key's namespace is not the fingerprint its record was produced under")
    try:
        codec.decode(codec.encode(record))  # every field of the type it must be
    except codec.CorruptRecord as exc:
        raise BadLine(str(exc)) from None
    return key, record
