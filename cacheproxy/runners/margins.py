"""Measuring near-tie margins on the device, from the log-probabilities of each decision.

A decision's gap is built from the log-probabilities the sampler saw and the token it drew (a
log-probability gap is the logit gap: both sides share the normalizer). The decisions are
kept as they come (their arrays already evaluated with their tokens) and their gaps built a
batch at a time, in one graph scheduled asynchronously, so measuring adds no synchronization
per token; the gaps are read back once, when the answer ends (`keys.margin` summarizes them).
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
    """The gaps of one generation, in decision order.

    A decision is kept as the (already evaluated) log-probabilities it was drawn from and its
    token; every `BATCH` decisions their gaps are built in one graph and scheduled together,
    so the cost per token is a list append (building and scheduling the few ops of a gap for
    each token cost ~100 µs at a 1,024 vocabulary, 3 % of the demo model's decode step), and
    at most `HELD` log-probabilities are held at a time (13 rows of a 152k vocabulary)."""

    BATCH = 32  # decisions per graph, at most; fewer for a large vocabulary:
    HELD = 1 << 21  # values of log-probabilities held at most (8 MiB of float32)

    def __init__(self) -> None:
        self._gaps: list[Any] = []  # lazy (n, 1) arrays, scheduled
        self._logprobs: list[Any] = []  # the decisions not yet in a gap: (rows, V) each
        self._tokens: list[Any] = []  # (rows,) each
        self._count = 0

    def add(self, logprobs: Any, token: Any) -> None:
        """Keep one decision: its (1, V) log-probabilities and its (1,) token."""
        self._logprobs.append(logprobs)
        self._tokens.append(token)
        self._count += 1
        if len(self._tokens) >= max(1, min(self.BATCH, self.HELD // logprobs.size)):
            self._schedule()

    @property
    def decisions(self) -> int:
        """Decisions kept so far."""
        return self._count

    def margin(self, decisions: int) -> Margin | None:
        """The margin over the first `decisions` gaps (the rest were decided ahead and
        dropped: mlx-lm computes one token past the end), or None when none was kept (not
        measured); one read back for all of them."""
        import mlx.core as mx

        self._schedule()
        kept, self._gaps, self._count = self._gaps, [], 0
        if not kept or decisions <= 0:
            return None
        values: list[float] = mx.concatenate(kept).reshape(-1)[:decisions].tolist()  # type: ignore[assignment]
        return summarize(values)

    def _schedule(self) -> None:
        import mlx.core as mx

        if not self._tokens:
            return
        gaps = gap(mx.concatenate(self._logprobs), mx.concatenate(self._tokens))
        mx.async_eval(gaps)  # type: ignore[no-untyped-call]
        self._gaps.append(gaps)
        self._logprobs, self._tokens = [], []


class MeasuringSampler:
    """Wraps a sampler of mlx-lm's `generate_step`: draws the token as it does, and keeps the
    decision for its gap (`Trail`)."""

    def __init__(self, sampler: Any, trail: Trail) -> None:
        self._sampler = sampler
        self._trail = trail

    def __call__(self, logprobs: Any) -> Any:
        token = self._sampler(logprobs)
        self._trail.add(logprobs, token)
        return token
