"""The stored record: encode/decode round trip, and every kind of damage is CorruptRecord."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheproxy.keys.codec import (
    MAGIC,
    RECORD_VERSION,
    Chunk,
    CorruptRecord,
    Output,
    Record,
    TokenLogprob,
    decode,
    encode,
)

REQUEST: dict[str, Any] = {
    "endpoint": "chat",
    "model": "demo",
    "messages": [{"role": "user", "content": "héllo 🦊"}],
    "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None},
    "stop": ["\n\n"],
    "logit_bias": [[5, -1.5]],
    "max_tokens": 16,
}
RECORD = Record(
    request=REQUEST,
    output=Output(
        chunks=(
            Chunk("", (7,)),  # a token whose text is still held back
            Chunk("héllo ", (1, 2, 3)),
            Chunk(
                "🦊 ✓",
                (4, 5),
                (
                    TokenLogprob(4, "\ufffd", -0.25, ((4, "\ufffd", -0.25), (9, "a", -1.5))),
                    TokenLogprob(5, " ✓", -0.0, ()),
                ),
            ),
            Chunk("", ()),
        ),
        finish_reason="stop",
        prompt_tokens=12,
        completion_tokens=6,
    ),
    provenance={"fingerprint": "f" * 32, "created": 1_700_000_000.5, "runner_ms": 12},
)


def frame(payload: bytes, *, magic: bytes = MAGIC, version: int = RECORD_VERSION) -> bytes:
    """Bytes laid out like a record, with a valid checksum over any payload."""
    return magic + bytes([version]) + xxhash.xxh3_64_digest(payload) + payload


def test_round_trip() -> None:
    assert decode(encode(RECORD)) == RECORD


def test_round_trip_keeps_text_and_tokens() -> None:
    output = decode(encode(RECORD)).output
    assert output.text == "héllo 🦊 ✓"
    assert output.token_ids == [7, 1, 2, 3, 4, 5]


def test_empty_output_round_trips() -> None:
    record = Record(request={}, output=Output((), "length", 0, 0))
    assert decode(encode(record)) == record


def test_layout_is_magic_version_checksum_payload() -> None:
    data = encode(RECORD)
    assert data.startswith(MAGIC)
    assert data[len(MAGIC)] == RECORD_VERSION
    assert data == frame(data[len(MAGIC) + 9 :])


def test_encoding_is_deterministic() -> None:
    assert encode(RECORD) == encode(decode(encode(RECORD)))


logprobs = st.builds(
    TokenLogprob,
    token=st.integers(0, 2**31),
    text=st.text(max_size=4),
    logprob=st.floats(max_value=0.0, allow_nan=False),
    top=st.lists(
        st.tuples(st.integers(0, 2**31), st.text(max_size=4), st.floats(allow_nan=False)),
        max_size=3,
    ).map(tuple),
)
chunks = st.builds(
    Chunk,
    text=st.text(max_size=10),
    tokens=st.lists(st.integers(0, 2**31), max_size=4).map(tuple),
    logprobs=st.lists(logprobs, max_size=3).map(tuple),
)
records = st.builds(
    Record,
    request=st.dictionaries(
        st.text(max_size=8), st.text() | st.integers(-(2**63), 2**64 - 1) | st.none(), max_size=4
    ),
    output=st.builds(
        Output,
        chunks=st.lists(chunks, max_size=5).map(tuple),
        finish_reason=st.sampled_from(["stop", "length", "cancelled"]),
        prompt_tokens=st.integers(0, 10**6),
        completion_tokens=st.integers(0, 10**6),
    ),
    provenance=st.dictionaries(
        st.text(max_size=8), st.text() | st.floats(allow_nan=False), max_size=3
    ),
)


@settings(max_examples=60, deadline=None)
@given(record=records)
def test_any_record_round_trips(record: Record) -> None:
    assert decode(encode(record)) == record


@pytest.mark.parametrize("length", [0, 1, len(MAGIC), len(MAGIC) + 1, len(MAGIC) + 8])
def test_shorter_than_the_header_is_corrupt(length: int) -> None:
    with pytest.raises(CorruptRecord):
        decode(encode(RECORD)[:length])


def test_every_truncation_is_corrupt() -> None:
    data = encode(RECORD)
    for length in range(len(data)):
        with pytest.raises(CorruptRecord):
            decode(data[:length])


def test_extra_trailing_bytes_are_corrupt() -> None:
    with pytest.raises(CorruptRecord):
        decode(encode(RECORD) + b"\x00")


def test_every_flipped_payload_byte_fails_the_checksum() -> None:
    data = encode(RECORD)
    header = len(MAGIC) + 1 + 8
    for i in range(header, len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x01
        with pytest.raises(CorruptRecord, match="checksum"):
            decode(bytes(damaged))


def test_flipped_checksum_byte_is_corrupt() -> None:
    damaged = bytearray(encode(RECORD))
    damaged[len(MAGIC) + 1] ^= 0xFF
    with pytest.raises(CorruptRecord, match="checksum"):
        decode(bytes(damaged))


@pytest.mark.parametrize("magic", [b"CPX", b"cpr", b"\x00\x00\x00", b"RPC"])
def test_wrong_magic_is_corrupt(magic: bytes) -> None:
    data = encode(RECORD)
    with pytest.raises(CorruptRecord, match="magic"):
        decode(magic + data[len(MAGIC) :])


def test_not_a_record_at_all_is_corrupt() -> None:
    with pytest.raises(CorruptRecord):
        decode(msgpack.packb({"request": {}, "output": {}}))


@pytest.mark.parametrize("version", [0, RECORD_VERSION + 1, 255])
def test_unknown_version_is_corrupt(version: int) -> None:
    payload = encode(RECORD)[len(MAGIC) + 9 :]
    with pytest.raises(CorruptRecord, match="version"):
        decode(frame(payload, version=version))


def _packed(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


GOOD_OUTPUT = {"chunks": [], "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 0}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x01",  # an array that promises two items and has one
        _packed(GOOD_OUTPUT) + b"\x00",  # trailing data after a valid object
        b"\xa2\xff\xfe",  # a str that is not UTF-8
        b"\x91" * 5000 + b"\xc0",  # arrays nested deeper than msgpack's stack
        _packed(None),
        _packed(1),
        _packed("record"),
        _packed([1, 2, 3]),
        _packed({}),
        _packed({"request": {}, "provenance": {}}),
        _packed({"request": {}, "output": GOOD_OUTPUT}),
        _packed({"request": {}, "output": None, "provenance": {}}),
        _packed({"request": {}, "output": [], "provenance": {}}),
        _packed({"request": {}, "output": {**GOOD_OUTPUT, "chunks": None}, "provenance": {}}),
        _packed({"request": {}, "output": {**GOOD_OUTPUT, "chunks": [["t"]]}, "provenance": {}}),
        _packed({"request": {}, "output": {**GOOD_OUTPUT, "chunks": [5]}, "provenance": {}}),
        _packed(
            {
                "request": {},
                "output": {**GOOD_OUTPUT, "chunks": [["t", [1], [[1, "a"]]]]},
                "provenance": {},
            }
        ),
        _packed(
            {"request": {}, "output": {**GOOD_OUTPUT, "chunks": [["t", 5, []]]}, "provenance": {}}
        ),
        _packed(
            {
                "request": {},
                "output": {**GOOD_OUTPUT, "chunks": [["t", [], [[1, "a", 0, 5]]]]},
                "provenance": {},
            }
        ),
        _packed(
            {
                "request": {},
                "output": {k: v for k, v in GOOD_OUTPUT.items() if k != "finish_reason"},
                "provenance": {},
            }
        ),
    ],
    ids=lambda p: f"{len(p)}B-{xxhash.xxh32_hexdigest(p)}",
)
def test_valid_checksum_over_a_non_record_is_corrupt(payload: bytes) -> None:
    with pytest.raises(CorruptRecord):
        decode(frame(payload))


@pytest.mark.parametrize(
    "payload",
    [
        _packed({"request": 5, "output": GOOD_OUTPUT, "provenance": {}}),
        _packed({"request": {}, "output": {**GOOD_OUTPUT, "finish_reason": 3}, "provenance": {}}),
        _packed({"request": {}, "output": {**GOOD_OUTPUT, "prompt_tokens": "1"}, "provenance": {}}),
        _packed(
            {"request": {}, "output": {**GOOD_OUTPUT, "chunks": [[5, [1], []]]}, "provenance": {}}
        ),
        _packed(
            {
                "request": {},
                "output": {**GOOD_OUTPUT, "chunks": [["t", ["a"], []]]},
                "provenance": {},
            }
        ),
        _packed({"request": {}, "output": GOOD_OUTPUT, "provenance": []}),
    ],
    ids=["request", "finish_reason", "prompt_tokens", "chunk_text", "chunk_tokens", "provenance"],
)
def test_wrongly_typed_fields_are_corrupt(payload: bytes) -> None:
    with pytest.raises(CorruptRecord):
        decode(frame(payload))


def test_the_stop_sequence_that_ended_an_answer_round_trips_and_costs_others_nothing() -> None:
    chunks = (Chunk("The fox", (1, 2)),)
    plain = Record(REQUEST, Output(chunks, "stop", 3, 2))
    cut = Record(REQUEST, Output(chunks, "stop", 3, 2, stop=" eats"))
    assert decode(encode(cut)).output.stop == " eats"
    assert decode(encode(plain)).output.stop == ""
    assert b"stop\xa5 eats" in encode(cut) and b"\xa4stop\xa5" not in encode(plain)
