"""The plan step: what to do with one request, decided from named inputs. Pure.

Inputs: the sampling decision (may this answer be cached, and why), the request's
Cache-Control directives, what the store lookup found (not looked up, store down, nothing,
an entry of some age) and whether a shared fill of the same key is running now.

Rows are tried in order; "any" matches every value of its column. A replaying server takes
the same table and refuses every row that is not "serve" (not recorded).

| found                       | directives           | fill running | action     | status    |
|-----------------------------|----------------------|--------------|------------|-----------|
| not looked up (uncacheable) | only-if-cached       | any          | (refused)  | -         |
| not looked up (uncacheable) | any                  | any          | generate   | BYPASS    |
| store down                  | only-if-cached       | any          | (refused)  | -         |
| store down                  | any                  | any          | generate   | BYPASS    |
| entry, usable               | any                  | any          | serve      | HIT       |
| entry, too old / no-cache   | only-if-cached       | any          | (refused)  | -         |
| entry, too old / no-cache   | any (no-store: kept) | any          | regenerate | MISS      |
| nothing                     | only-if-cached       | any          | (refused)  | -         |
| nothing                     | any                  | yes          | follow     | COALESCED |
| nothing                     | no-store             | no           | generate   | MISS      |
| nothing                     | any                  | no           | fill       | MISS      |
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from policies.cache_control import RequestDirectives, stored_answer_usable
from policies.sampling import Decision
from policies.status import CacheStatus, Reason


class Found(StrEnum):
    """What the store lookup found."""

    NOT_LOOKED_UP = "not-looked-up"  # the request is not cacheable: the store is not asked
    STORE_DOWN = "store-down"
    NOTHING = "nothing"
    ENTRY = "entry"


@dataclass(frozen=True, slots=True)
class Lookup:
    """The lookup's outcome; `age` (seconds since generation) only for an ENTRY."""

    found: Found
    age: float = 0.0


class Action(StrEnum):
    """What the service does next."""

    SERVE = "serve"  # the stored answer
    FILL = "fill"  # lead the shared fill of the key: generate once, store, others follow
    FOLLOW = "follow"  # join the shared fill already running
    REGENERATE = "regenerate"  # generate alone and replace the stored answer (unless no-store)
    GENERATE = "generate"  # generate alone, store nothing


@dataclass(frozen=True, slots=True)
class Plan:
    """The action, the status and reason it will be reported with, and whether the answer
    will be in the store."""

    action: Action
    status: CacheStatus
    reason: Reason
    stores: bool


@dataclass(frozen=True, slots=True)
class Refusal:
    """only-if-cached, and no stored answer may be served: why not."""

    reason: Reason
    why: str


def _refuse(why: str, reason: Reason) -> Refusal:
    return Refusal(reason, f"{why}, and only-if-cached was asked")


def plan(decision: Decision, directives: RequestDirectives, lookup: Lookup, *,
         fill_running: bool, replay: bool = False) -> Plan | Refusal:
    """The plan for a request (the table in the module docstring). A replaying server
    (`replay`) never generates: whatever would, is a request that was not recorded."""
    chosen = _plan(decision, directives, lookup, fill_running=fill_running)
    if replay and isinstance(chosen, Plan) and chosen.action is not Action.SERVE:
        if lookup.found is Found.STORE_DOWN:
            return Refusal(Reason.STORE_UNAVAILABLE,
                           "the store is unavailable, and this server only replays")
        return Refusal(Reason.NOT_RECORDED, f"no recorded answer ({chosen.reason})")
    return chosen


def _plan(decision: Decision, directives: RequestDirectives, lookup: Lookup, *,
          fill_running: bool) -> Plan | Refusal:
    never_generate = directives.only_if_cached
    if lookup.found is Found.NOT_LOOKED_UP:
        if never_generate:
            return _refuse(f"this request is never cached ({decision.reason})", decision.reason)
        return Plan(Action.GENERATE, CacheStatus.BYPASS, decision.reason, stores=False)
    if lookup.found is Found.STORE_DOWN:
        if never_generate:
            return _refuse("the store is unavailable", Reason.STORE_UNAVAILABLE)
        # Unshared: a follower of a fill that stores nothing would believe it was stored.
        return Plan(Action.GENERATE, CacheStatus.BYPASS, Reason.STORE_UNAVAILABLE, stores=False)
    if lookup.found is Found.ENTRY:
        fresh = stored_answer_usable(directives, lookup.age)
        if fresh.usable:
            return Plan(Action.SERVE, CacheStatus.HIT, decision.reason, stores=True)
        if never_generate:
            return _refuse(f"the stored answer is not usable ({fresh.reason})", fresh.reason)
        return Plan(Action.REGENERATE, CacheStatus.MISS, fresh.reason,
                    stores=not directives.no_store)
    if never_generate:
        return _refuse("no stored answer for this request", decision.reason)
    if fill_running:
        return Plan(Action.FOLLOW, CacheStatus.COALESCED, decision.reason, stores=True)
    if directives.no_store:
        # Lead no shared fill: its followers would miss again.
        return Plan(Action.GENERATE, CacheStatus.MISS, Reason.NO_STORE, stores=False)
    return Plan(Action.FILL, CacheStatus.MISS, decision.reason, stores=True)
