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


# The plan step: one case per row of policies/plan.py's table, and the refusals.

from policies.cache_control import RequestDirectives  # noqa: E402
from policies.plan import Action, Found, Lookup, Plan, Refusal, plan  # noqa: E402
from policies.status import CacheStatus, Reason  # noqa: E402

CACHEABLE = Decision(True, Reason.GREEDY)
NOT_CACHEABLE = Decision(False, Reason.SAMPLING)
ONLY = RequestDirectives(only_if_cached=True)
NO_STORE = RequestDirectives(no_store=True)
NO_CACHE = RequestDirectives(no_cache=True)
PLAIN = RequestDirectives()
M, H, C, B = CacheStatus.MISS, CacheStatus.HIT, CacheStatus.COALESCED, CacheStatus.BYPASS


@pytest.mark.parametrize(("decision", "directives", "lookup", "running", "expected"), [
    (NOT_CACHEABLE, PLAIN, Lookup(Found.NOT_LOOKED_UP), False,
     Plan(Action.GENERATE, B, Reason.SAMPLING, stores=False)),
    (CACHEABLE, PLAIN, Lookup(Found.STORE_DOWN), True,
     Plan(Action.GENERATE, B, Reason.STORE_UNAVAILABLE, stores=False)),
    (CACHEABLE, PLAIN, Lookup(Found.ENTRY, 5.0), True,
     Plan(Action.SERVE, H, Reason.GREEDY, stores=True)),
    (CACHEABLE, RequestDirectives(max_age=10), Lookup(Found.ENTRY, 5.0), False,
     Plan(Action.SERVE, H, Reason.GREEDY, stores=True)),
    (CACHEABLE, RequestDirectives(max_age=1), Lookup(Found.ENTRY, 5.0), False,
     Plan(Action.REGENERATE, M, Reason.MAX_AGE, stores=True)),
    (CACHEABLE, NO_CACHE, Lookup(Found.ENTRY), False,
     Plan(Action.REGENERATE, M, Reason.NO_CACHE, stores=True)),
    (CACHEABLE, RequestDirectives(no_cache=True, no_store=True), Lookup(Found.ENTRY), False,
     Plan(Action.REGENERATE, M, Reason.NO_CACHE, stores=False)),
    (CACHEABLE, PLAIN, Lookup(Found.NOTHING), True,
     Plan(Action.FOLLOW, C, Reason.GREEDY, stores=True)),
    (CACHEABLE, NO_STORE, Lookup(Found.NOTHING), True,
     Plan(Action.FOLLOW, C, Reason.GREEDY, stores=True)),
    (CACHEABLE, NO_STORE, Lookup(Found.NOTHING), False,
     Plan(Action.GENERATE, M, Reason.NO_STORE, stores=False)),
    (CACHEABLE, PLAIN, Lookup(Found.NOTHING), False,
     Plan(Action.FILL, M, Reason.GREEDY, stores=True)),
    (Decision(True, Reason.SEEDED), PLAIN, Lookup(Found.NOTHING), False,
     Plan(Action.FILL, M, Reason.SEEDED, stores=True)),
])
def test_the_plan_follows_its_table(decision: Decision, directives: RequestDirectives,
                                    lookup: Lookup, running: bool, expected: Plan) -> None:
    assert plan(decision, directives, lookup, fill_running=running) == expected


@pytest.mark.parametrize(("decision", "lookup", "reason", "words"), [
    (NOT_CACHEABLE, Lookup(Found.NOT_LOOKED_UP), Reason.SAMPLING, "never cached"),
    (CACHEABLE, Lookup(Found.STORE_DOWN), Reason.STORE_UNAVAILABLE, "unavailable"),
    (CACHEABLE, Lookup(Found.NOTHING), Reason.GREEDY, "no stored answer"),
])
def test_only_if_cached_refuses_whenever_nothing_may_be_served(
    decision: Decision, lookup: Lookup, reason: Reason, words: str
) -> None:
    refused = plan(decision, ONLY, lookup, fill_running=True)
    assert isinstance(refused, Refusal) and refused.reason is reason
    assert words in refused.why and "only-if-cached" in refused.why
    stale = plan(CACHEABLE, RequestDirectives(only_if_cached=True, no_cache=True),
                 Lookup(Found.ENTRY), fill_running=False)
    assert isinstance(stale, Refusal) and stale.reason is Reason.NO_CACHE
    assert isinstance(plan(CACHEABLE, ONLY, Lookup(Found.ENTRY), fill_running=False), Plan)
