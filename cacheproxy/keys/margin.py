"""Near-tie margins: how close an answer came to another one.

At each generated token the runner measures the gap between the chosen token's logit and
the best other token's (on the logits the sampler saw: after penalties, bias and grammar
mask). A one-bit wobble (another batch shape, kernel, mlx version) or a requantization can
only flip a greedy argmax where that gap is small, so the smallest gap of an answer says how
fragile its bytes are. Stored in the entry's provenance under ``margin``; entries made before
it, or by an upstream mlx_lm.server (which does not expose its logits), have none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NEAR_TIE = 1e-2
"""Gap (in logits, i.e. nats of log-probability) under which a token counts as a near tie.

A float32 one-bit wobble moves a logit of magnitude ~10 by ~1e-6; a change of kernel or
reduction order sums the same terms in another order, a few such wobbles per layer. 1e-2 is far
above that, and catches the decisions another runtime can flip.
"""

LOWEST = 8
"""The smallest gaps kept with their token index: `compare` reads the gap at the token where a
replay diverged from them (a divergence elsewhere had a gap at least the largest kept)."""

FRAGILE_BELOW = NEAR_TIE
"""Default threshold of `cacheproxy stats --fragile-below`: an answer whose smallest gap is
below it is fragile (its bytes may change under another runtime or quantization)."""


@dataclass(frozen=True, slots=True)
class Margin:
    """The smallest gap of one answer, where it occurred and how many near ties it had.

    `smallest` is None when no token had a runner-up (every step forced by a grammar, or
    nothing generated). `at` is the token index of the smallest gap: an index into the
    answer's token ids, or their count when it was the end-of-sequence decision."""

    smallest: float | None
    at: int | None
    near_ties: int  # tokens whose gap was below `epsilon`
    tokens: int  # decisions measured (generated tokens, and the end-of-sequence one if any)
    epsilon: float = NEAR_TIE
    lowest: tuple[tuple[int, float], ...] = ()  # the `LOWEST` smallest (token index, gap)

    def gap_at(self, index: int) -> tuple[float | None, float | None]:
        """The gap at a token: (exactly, None) when it is among the smallest kept, else (None,
        a lower bound: the largest kept) when the answer had more decisions than that."""
        for at, value in self.lowest:
            if at == index:
                return value, None
        return None, self.lowest[-1][1] if len(self.lowest) == LOWEST else None

    def fragile(self, below: float = FRAGILE_BELOW) -> bool:
        """Whether the answer's smallest gap is under `below`."""
        return self.smallest is not None and self.smallest < below

    def wire(self) -> dict[str, Any]:
        """The provenance form (msgpack and JSON safe: no infinities)."""
        return {"smallest": self.smallest, "at": self.at, "near_ties": self.near_ties,
                "tokens": self.tokens, "epsilon": self.epsilon,
                "lowest": [[at, value] for at, value in self.lowest]}

    def describe(self) -> str:
        """One line for `inspect`."""
        if self.smallest is None:
            return f"no runner-up at any of {self.tokens} tokens (every step forced)"
        return (f"smallest gap {self.smallest:.4g} at token {self.at}; {self.near_ties} of "
                f"{self.tokens} tokens within {self.epsilon:g}")


def summarize(gaps: Sequence[float], epsilon: float = NEAR_TIE) -> Margin:
    """The margin of an answer from the gap at each of its decisions (inf: forced)."""
    finite = [(g, i) for i, g in enumerate(gaps) if math.isfinite(g)]
    near = sum(1 for g, _ in finite if g < epsilon)
    if not finite:
        return Margin(None, None, 0, len(gaps), epsilon)
    lowest = tuple((at, float(g)) for g, at in sorted(finite)[:LOWEST])
    return Margin(lowest[0][1], lowest[0][0], near, len(gaps), epsilon, lowest)


def from_provenance(provenance: Mapping[str, Any]) -> Margin | None:
    """The margin a record's provenance holds; None when it has none (or a malformed one)."""
    raw = provenance.get("margin")
    if not isinstance(raw, Mapping):
        return None
    try:
        smallest, at = raw["smallest"], raw["at"]
        lowest = tuple((int(i), float(g)) for i, g in raw.get("lowest") or ())
        return Margin(None if smallest is None else float(smallest),
                      None if at is None else int(at), int(raw["near_ties"]),
                      int(raw["tokens"]), float(raw.get("epsilon", NEAR_TIE)), lowest)
    except (KeyError, TypeError, ValueError):
        return None
