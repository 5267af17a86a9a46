"""Sampling policy: which requests are cacheable, and the determinism rewrite. Pure.

Modes:
- force-greedy: every request is generated greedy; sampling knobs are rewritten away
  (and the response says so), so every request is cacheable.
- seeded: temperature > 0 is cacheable only with an explicit seed, which joins the
  key; unseeded sampling is passed through uncached (BYPASS).
- bypass: temperature > 0 is passed through uncached.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import assert_never

from policies.status import Reason


class SamplingMode(StrEnum):
    """How requests that ask for sampling are treated."""

    FORCE_GREEDY = "force-greedy"
    SEEDED = "seeded"
    BYPASS = "bypass"


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampler parameters; greedy is temperature 0 with everything else neutral."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        """True when the sampler is argmax."""
        return self.temperature == 0.0


GREEDY = Sampling()


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether an answer may be served from and stored in the cache, and why."""

    cacheable: bool
    reason: Reason


@dataclass(frozen=True, slots=True)
class SamplingOutcome:
    """The sampling actually used, the cache decision, and a note for the client."""

    sampling: Sampling
    decision: Decision
    rewritten: bool


def resolve_sampling(requested: Sampling, mode: SamplingMode) -> SamplingOutcome:
    """Apply the mode: greedy drops every knob that cannot change an argmax."""
    if requested.is_greedy:
        # top_p/top_k/min_p/seed cannot change an argmax: drop them from the key.
        return SamplingOutcome(GREEDY, Decision(True, Reason.GREEDY), rewritten=False)
    match mode:
        case SamplingMode.FORCE_GREEDY:
            return SamplingOutcome(GREEDY, Decision(True, Reason.FORCED_GREEDY), rewritten=True)
        case SamplingMode.SEEDED:
            if requested.seed is None:
                return SamplingOutcome(requested, Decision(False, Reason.UNSEEDED_SAMPLING),
                                       rewritten=False)
            return SamplingOutcome(requested, Decision(True, Reason.SEEDED), rewritten=False)
        case SamplingMode.BYPASS:
            return SamplingOutcome(requested, Decision(False, Reason.SAMPLING), rewritten=False)
        case _:
            assert_never(mode)
