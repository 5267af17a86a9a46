"""A stored record as one line of JSON: lossless, readable, checksummed.

The line holds the key, the canonical request, the output (its text, reasoning and tool
calls for a reader, then every chunk as generated: text, token ids, logprobs, reasoning,
calls), the provenance and `checksum`: the xxh3_64 of the record's stored encoding
(`codec.encode`). Reading a line rebuilds the record from its chunks, re-encodes it and
compares: one changed token, one changed character, and the line is refused; the readable
summary must agree with the chunks too. JSON keeps every float exactly (shortest repr) and
every key order, so a record read back encodes to the very bytes it was exported from.

The checksum proves a line was not damaged by accident; anyone can recompute it, so it proves
nothing about who wrote the line. With a record key (`--record-key`), every line also carries
`signature`: the HMAC-SHA256 of its key and its record's stored encoding under that secret;
reading then refuses a line without one or with another (a forged or edited recording).
Lines are read a bounded length at a time (MAX_LINE): a huge line is refused once that much
has arrived, never read whole.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from typing import Any, BinaryIO

import orjson
import xxhash

from cacheproxy.keys import codec


class BadLine(ValueError):
    """A line that is not a valid, untampered record."""


def checksum(record: codec.Record) -> str:
    """The xxh3_64 (hex) of the record's stored encoding."""
    return xxhash.xxh3_64_hexdigest(codec.encode(record))


MAX_LINE = 64 << 20  # bytes of one line (an answer at --max-answer-tokens is ~16 MB of JSON)


def signature(secret: bytes, key: str, record: codec.Record) -> str:
    """The HMAC-SHA256 (hex) of an entry's key and its record's stored encoding."""
    message = key.encode("utf-8", "surrogateescape") + b"\n" + codec.encode(record)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def to_line(key: str, record: codec.Record, *, secret: bytes = b"") -> bytes:
    """The JSON line of one entry (a newline at the end), signed when a secret is given."""
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
    if secret:
        line["signature"] = signature(secret, key, record)
    return orjson.dumps(line) + b"\n"


def read(stream: BinaryIO, where: str, *, secret: bytes = b"",
         max_line: int = MAX_LINE) -> Iterator[tuple[str, codec.Record]]:
    """Every (key, record) of a stream of lines, read one bounded line at a time; ValueError
    `<where>: line N: ...` at the first line that is too long, malformed or does not verify."""
    number = 0
    while line := stream.readline(max_line + 1):
        number += 1
        if len(line) > max_line:
            raise ValueError(f"{where}: line {number}: longer than {max_line} bytes: refused "
                             "unread")
        if not line.strip():
            continue
        try:
            yield from_line(line, secret=secret)
        except BadLine as exc:
            raise ValueError(f"{where}: line {number}: {exc}") from None


def _chunk(c: dict[str, Any]) -> codec.Chunk:
    logprobs = tuple(codec.TokenLogprob(t, s, lp, tuple((a, b, v) for a, b, v in top))
                     for t, s, lp, top in c["logprobs"])
    calls = tuple(codec.ToolCallOut(i, n, a) for i, n, a in c["tool_calls"])
    return codec.Chunk(c["text"], tuple(c["tokens"]), logprobs, c["reasoning"], calls)


def from_line(data: bytes, *, secret: bytes = b"") -> tuple[str, codec.Record]:
    """(key, record) of one line; BadLine when it is malformed, does not verify, or (with a
    secret) is not signed with it."""
    try:
        line = orjson.loads(data)
        o = line["output"]
        output = codec.Output(tuple(_chunk(c) for c in o["chunks"]), o["finish_reason"],
                              o["prompt_tokens"], o["completion_tokens"])
        record = codec.Record(line["request"], output, line["provenance"])
        key, expected = line["key"], line["checksum"]
        summary = (o.get("text"), o.get("reasoning"),
                   [(t.get("index"), t.get("name"), t.get("arguments"))
                    for t in o["tool_calls"]])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError,
            IndexError) as exc:  # a field of the wrong shape: `tool_calls: ["x"]`
        raise BadLine(f"not a record line: {_what(exc)}") from None
    if summary != (output.text, output.reasoning,
                   [(t.index, t.name, t.arguments) for t in output.tool_calls]):
        raise BadLine("the text, reasoning or tool calls disagree with the chunks")
    try:
        actual = checksum(record)
    except (TypeError, ValueError, AttributeError) as exc:
        raise BadLine(f"the record does not encode: {exc}") from None
    if not isinstance(key, str) or actual != expected:
        raise BadLine(f"checksum mismatch: the line says {expected}, its record is {actual}")
    if secret:
        signed = line.get("signature")
        if not isinstance(signed, str):
            raise BadLine("unsigned record: a record key is configured, and this line has no "
                          "signature")
        if not hmac.compare_digest(signed, signature(secret, key, record)):
            raise BadLine("signature mismatch: not signed with the configured record key "
                          "(forged, edited, or signed with another key)")
    if not isinstance(record.provenance, dict) or \
            key.partition("/")[0] != record.provenance.get("fingerprint"):
        raise BadLine("the key's namespace is not the fingerprint its record was produced under")
    try:
        codec.decode(codec.encode(record))  # every field of the type it must be
    except codec.CorruptRecord as exc:
        raise BadLine(str(exc)) from None
    return key, record


def _what(exc: Exception) -> str:
    """An exception's kind and message, short (it may quote a whole field)."""
    return f"{type(exc).__name__}: {str(exc)[:200]}"
