"""A record as a JSON line: read back to the very bytes it was exported from, and refused when
one token, one character or its checksum changes."""

from __future__ import annotations

import json

import pytest

from cacheproxy.keys import codec, transcript

RECORD = codec.Record(
    request={"endpoint": "chat", "messages": [{"role": "user", "content": "Weather in Paris?"}],
             "sampling": {"temperature": 0.0, "seed": None}, "logit_bias": [[5, -1.5]]},
    output=codec.Output(
        chunks=(codec.Chunk("", (11, 12), (), reasoning="The user asks."),
                codec.Chunk("It is sunny.", (13, 14),
                            (codec.TokenLogprob(13, "It", -0.1234567890123, ((13, "It", -0.12),
                                                                               (9, "The", -2.5))),
                             codec.TokenLogprob(14, " is sunny.", -1e-7))),
                codec.Chunk("", (15,), tool_calls=(codec.ToolCallOut(0, "get_weather",
                                                                     '{"city": "Paris"}'),))),
        finish_reason="tool_calls", prompt_tokens=21, completion_tokens=5),
    provenance={"fingerprint": "f" * 32, "created_at": 1796115531.2499526,
                "fingerprint_fields": {"quantization": {"bits": None}}})


def test_a_line_reads_back_to_the_same_bytes() -> None:
    line = transcript.to_line("f" * 32 + "/abc", RECORD)
    key, record = transcript.from_line(line)
    assert key == "f" * 32 + "/abc"
    assert codec.encode(record) == codec.encode(RECORD)
    data = json.loads(line)
    assert data["output"]["text"] == "It is sunny." and data["output"]["reasoning"]
    assert data["output"]["tool_calls"] == [{"index": 0, "name": "get_weather",
                                             "arguments": '{"city": "Paris"}'}]


@pytest.mark.parametrize("tamper", [
    lambda d: d["output"]["chunks"][1]["tokens"].__setitem__(0, 99),
    lambda d: d["output"]["chunks"][1]["logprobs"][0].__setitem__(2, -0.1234567890124),
    lambda d: d["output"]["chunks"][2]["tool_calls"][0].__setitem__(2, '{"city": "Lyon"}'),
    lambda d: d["request"]["messages"][0].__setitem__("content", "Weather in Lyon?"),
    lambda d: d["provenance"].__setitem__("created_at", 0.0),
    lambda d: d.__setitem__("checksum", "0" * 16),
], ids=["token", "logprob", "call", "request", "provenance", "checksum"])
def test_any_change_fails_the_checksum(tamper: object) -> None:
    data = json.loads(transcript.to_line("k/1", RECORD))
    tamper(data)  # type: ignore[operator]
    with pytest.raises(transcript.BadLine, match="checksum|disagree"):
        transcript.from_line(json.dumps(data).encode())


@pytest.mark.parametrize(("field", "value"), [("text", "It rains."), ("reasoning", ""),
                                               ("tool_calls", [])])
def test_the_readable_summary_must_agree_with_the_chunks(field: str, value: object) -> None:
    data = json.loads(transcript.to_line("k/1", RECORD))
    data["output"][field] = value
    with pytest.raises(transcript.BadLine, match="disagree"):
        transcript.from_line(json.dumps(data).encode())


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"key": "k"}',
                                 b'{"key": 1, "output": {}}'])
def test_malformed_lines_are_refused(raw: bytes) -> None:
    with pytest.raises(transcript.BadLine):
        transcript.from_line(raw)


def test_a_key_outside_its_records_namespace_is_refused() -> None:
    # The checksum covers the record, not the key: the key is checked against the record.
    data = json.loads(transcript.to_line("f" * 32 + "/abc", RECORD))
    data["key"] = "e" * 32 + "/abc"
    with pytest.raises(transcript.BadLine, match="namespace"):
        transcript.from_line(json.dumps(data).encode())
