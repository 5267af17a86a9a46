"""Near-tie margins as data: the summary of an answer's gaps, and its provenance form (an
entry stored before margins existed still decodes, with none)."""

from __future__ import annotations

import math

import pytest

from cacheproxy.keys import codec
from cacheproxy.keys.margin import LOWEST, NEAR_TIE, Margin, from_provenance, summarize

OUTPUT = codec.Output((codec.Chunk("hi", (5, 6)),), "stop", 3, 2)


def test_summary_of_gaps_skips_forced_decisions() -> None:
    gaps = [3.0, math.inf, 0.004, 0.5, 0.009, math.inf]
    margin = summarize(gaps)
    assert (margin.smallest, margin.at, margin.near_ties, margin.tokens) == (0.004, 2, 2, 6)
    assert margin.lowest == ((2, 0.004), (4, 0.009), (3, 0.5), (0, 3.0))
    assert margin.fragile() and not margin.fragile(below=0.001)
    forced = summarize([math.inf, math.inf])
    assert forced.smallest is None and forced.at is None and not forced.fragile()
    assert "forced" in forced.describe()


def test_the_gap_at_a_divergence_is_known_exactly_or_bounded() -> None:
    margin = summarize([float(i) for i in range(20)])  # 20 decisions, 8 kept
    assert len(margin.lowest) == LOWEST
    assert margin.gap_at(3) == (3.0, None)
    assert margin.gap_at(15) == (None, 7.0)  # not kept: at least the largest kept
    short = summarize([1.0, 2.0])
    assert short.gap_at(1) == (2.0, None) and short.gap_at(5) == (None, None)


def test_provenance_round_trip_through_the_record_codec() -> None:
    margin = summarize([0.2, 0.001, 7.0])
    record = codec.Record({"endpoint": "chat"}, OUTPUT, {"margin": margin.wire()})
    back = from_provenance(codec.decode(codec.encode(record)).provenance)
    assert back == margin and back.epsilon == NEAR_TIE


def test_an_entry_without_a_margin_or_with_a_damaged_one_has_none() -> None:
    old = codec.decode(codec.encode(codec.Record({"endpoint": "chat"}, OUTPUT,
                                                 {"fingerprint": "f" * 32})))
    assert from_provenance(old.provenance) is None
    for damaged in ({"smallest": "x", "at": 1, "near_ties": 0, "tokens": 1}, {"at": 1}, 5,
                    {"smallest": 0.1, "at": 1, "near_ties": 0, "tokens": 1, "lowest": [[1]]}):
        assert from_provenance({"margin": damaged}) is None
    # (The control: the same shape undamaged reads back.)
    assert from_provenance({"margin": {"smallest": 0.1, "at": 1, "near_ties": 0,
                                       "tokens": 1}}) == Margin(0.1, 1, 0, 1)


@pytest.mark.parametrize("gaps", [[], [math.inf]])
def test_nothing_to_measure(gaps: list[float]) -> None:
    assert summarize(gaps).smallest is None
