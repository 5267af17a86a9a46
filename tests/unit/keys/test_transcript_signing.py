"""Signed record lines: with a record key, a forged line (checksum recomputed, as anyone can)
is refused, and so is an unsigned one; malformed fields and over-long lines are line-numbered
errors, never tracebacks. Pure: no store, no event loop."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import xxhash

from cacheproxy.keys import codec, transcript

RECORD = codec.Record(  # (its own copy: test files are being moved between tiers)
    request={"endpoint": "chat", "messages": [{"role": "user", "content": "Weather in Paris?"}],
             "sampling": {"temperature": 0.0, "seed": None}},
    output=codec.Output(
        chunks=(codec.Chunk("", (11, 12), (), reasoning="The user asks."),
                codec.Chunk("It is sunny.", (13, 14), ()),
                codec.Chunk("", (15,), tool_calls=(codec.ToolCallOut(0, "get_weather",
                                                                     '{"city": "Paris"}'),))),
        finish_reason="tool_calls", prompt_tokens=21, completion_tokens=5),
    provenance={"fingerprint": "f" * 32, "created_at": 1796115531.25,
                "fingerprint_fields": {"quantization": {"bits": None}}})

KEY = "f" * 32 + "/abc"
SECRET = b"a record key"


def forged(line: bytes) -> bytes:
    """The line with another answer, its checksum recomputed as a forger would."""
    data = json.loads(line)
    data["output"]["chunks"][1]["text"] = data["output"]["text"] = "It is raining."
    rebuilt = codec.Record(RECORD.request, codec.Output(
        (RECORD.output.chunks[0], codec.Chunk("It is raining.", RECORD.output.chunks[1].tokens,
                                              RECORD.output.chunks[1].logprobs),
         RECORD.output.chunks[2]), "tool_calls", 21, 5), RECORD.provenance)
    data["checksum"] = xxhash.xxh3_64_hexdigest(codec.encode(rebuilt))
    return json.dumps(data).encode() + b"\n"


def test_a_signed_line_reads_back_and_a_forged_one_is_refused() -> None:
    line = transcript.to_line(KEY, RECORD, secret=SECRET)
    assert transcript.from_line(line, secret=SECRET)[0] == KEY
    fake = forged(line)
    # Control: without a key the forgery passes (the checksum proves no authorship).
    assert transcript.from_line(fake)[1].output.text == "It is raining."
    with pytest.raises(transcript.BadLine, match="signature mismatch"):
        transcript.from_line(fake, secret=SECRET)
    with pytest.raises(transcript.BadLine, match="signature mismatch"):
        transcript.from_line(line, secret=b"another key")


def test_an_unsigned_line_is_refused_when_a_key_is_configured() -> None:
    line = transcript.to_line(KEY, RECORD)
    assert transcript.from_line(line)[0] == KEY  # control: fine without a key
    with pytest.raises(transcript.BadLine, match="unsigned record"):
        transcript.from_line(line, secret=SECRET)


def test_a_signature_covers_the_key() -> None:
    data = json.loads(transcript.to_line(KEY, RECORD, secret=SECRET))
    data["key"] = "f" * 32 + "/other"  # the same record moved under another request's key
    with pytest.raises(transcript.BadLine, match="signature mismatch"):
        transcript.from_line(json.dumps(data).encode(), secret=SECRET)


def _with(path: tuple[Any, ...], value: Any) -> bytes:
    data = json.loads(transcript.to_line(KEY, RECORD))
    target = data
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return json.dumps(data).encode() + b"\n"


@pytest.mark.parametrize("path, value", [
    (("output", "tool_calls"), ["x"]),
    (("output", "tool_calls"), [[1, 2]]),
    (("output", "chunks"), ["x"]),
    (("output", "chunks"), [{"text": 1}]),
    (("output",), "x"),
    (("provenance",), ["x"]),
    (("request",), 5),
    (("key",), 7),
])
def test_every_malformed_field_is_a_line_numbered_error(path: tuple[Any, ...],
                                                        value: Any) -> None:
    good = transcript.to_line(KEY, RECORD)
    stream = io.BytesIO(good + _with(path, value))
    with pytest.raises(ValueError, match=r"^cassette: line 2: "):
        list(transcript.read(stream, "cassette"))


def test_a_line_over_the_bound_is_refused_before_it_is_read_whole() -> None:
    good = transcript.to_line(KEY, RECORD)

    class Counting(io.BytesIO):
        read_bytes = 0

        def readline(self, size: int | None = -1) -> bytes:
            data = super().readline(size)
            Counting.read_bytes += len(data)
            return data

    stream = Counting(good + b"x" * 5_000_000 + b"\n" + good)
    with pytest.raises(ValueError, match=r"line 2: longer than 4096 bytes"):
        list(transcript.read(stream, "f", max_line=4096))
    assert Counting.read_bytes < len(good) + 4096 + 2  # 5 MB never read
