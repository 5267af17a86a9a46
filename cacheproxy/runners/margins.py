"""Measuring near-tie margins on the device, in the graph of the token being decoded.

Each decision's gap is a lazy scalar built from the log-probabilities the sampler saw and the
token it drew (a log-probability gap is the logit gap: both sides share the normalizer), and
is evaluated with that token, so measuring adds no synchronization per token; the gaps are
read back once, when the answer ends (`keys.margin` summarizes them).
"""

from __future__ import annotations

from typing import Any

from cacheproxy.keys.margin import Margin, summarize


def gap(logprobs: Any, token: Any) -> Any:
    """The chosen token's lead over the best other token, per row (lazy).

    `logprobs` is (rows, V), `token` (rows,); the gaps are (rows, 1). Negative when the
    sampler drew a token that was not the most likely; +inf when only one token was possible
    (a grammar forced it). Two passes over the row (a copy with the chosen token masked, and
    its max): on the CPU a top-2 partition of a 152k vocabulary costs ten times more."""
    import mlx.core as mx

    index = token[:, None]  # (as few ops as can do: this runs once per token)
    chosen = mx.take_along_axis(logprobs, index, axis=-1)
    others = mx.put_along_axis(logprobs, index, _minus_infinity(logprobs.dtype), axis=-1)
    return chosen - mx.max(others, axis=-1, keepdims=True)  # (rows, 1)


_MINUS_INFINITY: dict[Any, Any] = {}


def _minus_infinity(dtype: Any) -> Any:
    import mlx.core as mx

    if dtype not in _MINUS_INFINITY:
        _MINUS_INFINITY[dtype] = mx.array(-mx.inf, dtype)
    return _MINUS_INFINITY[dtype]


class Trail:
    """The gaps of one generation, in decision order (lazy arrays until `margin`)."""

    def __init__(self) -> None:
        self._gaps: list[Any] = []

    def add(self, gaps: Any) -> None:
        """Keep one decision's gap (already scheduled for evaluation with its token)."""
        self._gaps.append(gaps)

    @property
    def decisions(self) -> int:
        """Gaps kept so far."""
        return len(self._gaps)

    def margin(self, decisions: int) -> Margin | None:
        """The margin over the first `decisions` gaps (the rest were decided ahead and
        dropped: mlx-lm computes one token past the end), or None when none was kept (not
        measured); one read back for all of them."""
        import mlx.core as mx

        kept = self._gaps[:decisions]
        self._gaps = []
        if not kept:
            return None
        values: list[float] = mx.concatenate(kept).reshape(-1).tolist()  # type: ignore[assignment]
        return summarize(values)


class MeasuringSampler:
    """Wraps a sampler of mlx-lm's `generate_step`: draws the token as it does, and schedules
    the decision's gap with it (evaluated asynchronously, as generate_step does its token)."""

    def __init__(self, sampler: Any, trail: Trail) -> None:
        self._sampler = sampler
        self._trail = trail

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx

        token = self._sampler(logprobs)
        measured = gap(logprobs, token)
        mx.async_eval(measured)  # type: ignore[no-untyped-call]  # with the token's: no wait
        self._trail.add(measured)
        return token
