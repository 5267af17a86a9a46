"""`replay.difference` (what `verify` and `compare` call a difference): with logprobs, each
token's log-probability and its top alternatives, as stored (after the codec) and replayed."""

from __future__ import annotations

from cacheproxy.cli.replay import Difference, difference
from cacheproxy.keys import codec
from cacheproxy.keys.codec import Chunk, Output, TokenLogprob


def out(*tops: tuple[tuple[int, str, float], ...], logprob: float = -0.25) -> Output:
    lps = tuple(TokenLogprob(7, "fox", logprob, top) for top in tops)
    return Output((Chunk("fox" * len(tops), (7,) * len(tops), lps),), "length", 3, len(tops))


def stored(output: Output) -> Output:
    """As verify reads it: encoded into a record and decoded again."""
    return codec.decode(codec.encode(codec.Record({"model": "m"}, output))).output


def test_the_same_logprobs_and_alternatives_after_the_codec_are_no_difference() -> None:
    answer = out(((7, "fox", -0.25), (9, "owl", -1.5)), ((7, "fox", -0.5),))
    assert difference(stored(answer), answer, logprobs=True) is None


def test_another_top_alternative_is_a_logprobs_difference_at_its_token() -> None:
    answer = out(((7, "fox", -0.25), (9, "owl", -1.5)), ((7, "fox", -0.5), (9, "owl", -2.0)))
    other = out(((7, "fox", -0.25), (9, "owl", -1.5)), ((7, "fox", -0.5), (9, "owl", -2.25)))
    assert difference(stored(answer), other, logprobs=True) == Difference("logprobs differ", 1)
    assert difference(stored(answer), other, logprobs=False) is None  # (compare's setting)


def test_another_chosen_logprob_is_a_logprobs_difference() -> None:
    answer = out(((7, "fox", -0.25),))
    assert difference(stored(answer), out(((7, "fox", -0.25),), logprob=-0.3),
                      logprobs=True) == Difference("logprobs differ", 0)
