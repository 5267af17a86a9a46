"""The sampling policy: every mode against greedy, seeded and unseeded sampling."""

from __future__ import annotations

import pytest

from policies.sampling import GREEDY, Decision, Sampling, SamplingMode, resolve_sampling

FORCE, SEEDED, BYPASS = SamplingMode.FORCE_GREEDY, SamplingMode.SEEDED, SamplingMode.BYPASS
GREEDY_WITH_KNOBS = Sampling(temperature=0.0, top_p=0.5, top_k=40, min_p=0.1, seed=7)
UNSEEDED = Sampling(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)
SEEDED_SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7)


@pytest.mark.parametrize("mode", list(SamplingMode))
@pytest.mark.parametrize("requested", [GREEDY, GREEDY_WITH_KNOBS, Sampling(seed=0)])
def test_greedy_is_cacheable_in_every_mode_and_drops_knobs(
    mode: SamplingMode, requested: Sampling
) -> None:
    outcome = resolve_sampling(requested, mode)
    assert outcome.sampling == GREEDY
    assert outcome.decision == Decision(True, "greedy")
    assert outcome.rewritten is False


@pytest.mark.parametrize("requested", [UNSEEDED, SEEDED_SAMPLING])
def test_force_greedy_rewrites_sampling(requested: Sampling) -> None:
    outcome = resolve_sampling(requested, FORCE)
    assert outcome.sampling == GREEDY
    assert outcome.sampling.seed is None
    assert outcome.decision == Decision(True, "forced-greedy")
    assert outcome.rewritten is True


def test_seeded_mode_caches_seeded_sampling_unchanged() -> None:
    outcome = resolve_sampling(SEEDED_SAMPLING, SEEDED)
    assert outcome.sampling == SEEDED_SAMPLING
    assert outcome.decision == Decision(True, "seeded")
    assert outcome.rewritten is False


def test_seeded_mode_bypasses_unseeded_sampling() -> None:
    outcome = resolve_sampling(UNSEEDED, SEEDED)
    assert outcome.sampling == UNSEEDED
    assert outcome.decision == Decision(False, "unseeded-sampling")
    assert outcome.rewritten is False


@pytest.mark.parametrize("requested", [UNSEEDED, SEEDED_SAMPLING])
def test_bypass_mode_never_caches_sampling(requested: Sampling) -> None:
    outcome = resolve_sampling(requested, BYPASS)
    assert outcome.sampling == requested
    assert outcome.decision == Decision(False, "sampling")
    assert outcome.rewritten is False


@pytest.mark.parametrize(
    ("mode", "requested", "cacheable", "reason"),
    [
        (FORCE, GREEDY, True, "greedy"),
        (FORCE, UNSEEDED, True, "forced-greedy"),
        (FORCE, SEEDED_SAMPLING, True, "forced-greedy"),
        (SEEDED, GREEDY, True, "greedy"),
        (SEEDED, UNSEEDED, False, "unseeded-sampling"),
        (SEEDED, SEEDED_SAMPLING, True, "seeded"),
        (BYPASS, GREEDY, True, "greedy"),
        (BYPASS, UNSEEDED, False, "sampling"),
        (BYPASS, SEEDED_SAMPLING, False, "sampling"),
    ],
)
def test_decision_table(
    mode: SamplingMode, requested: Sampling, cacheable: bool, reason: str
) -> None:
    assert resolve_sampling(requested, mode).decision == Decision(cacheable, reason)


@pytest.mark.parametrize("mode", list(SamplingMode))
def test_tiny_temperature_is_sampling_not_greedy(mode: SamplingMode) -> None:
    tiny = Sampling(temperature=1e-9, seed=1)
    assert not tiny.is_greedy
    assert resolve_sampling(tiny, mode).decision.reason != "greedy"


def test_seed_zero_counts_as_a_seed() -> None:
    requested = Sampling(temperature=1.0, seed=0)
    assert resolve_sampling(requested, SEEDED).decision == Decision(True, "seeded")


def test_modes_parse_from_their_names() -> None:
    assert [SamplingMode(m) for m in ("force-greedy", "seeded", "bypass")] == [
        FORCE,
        SEEDED,
        BYPASS,
    ]
