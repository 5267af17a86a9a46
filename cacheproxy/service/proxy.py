"""CachingProxy: the order of operations for one request.

0. (the edge) a repeat of a remembered HIT (the same body bytes, no Cache-Control): the edge
   sends its remembered response again while the service vouches for the HIT (`holds`
   without I/O or a coroutine, else `still_stored`; the rule is in `memos`) -> HIT
1. parse: validate the body, build the canonical request and the sampling decision (400s);
   a body with schemas, or a large one, on the parse pool (never on the loop: `parsing`)
2. wait while a reload holds requests; key = make_key(request, serving fingerprint)
3. look up the store, unless the request is not cacheable: a store failure is "store down",
   a corrupt or foreign record is "nothing" (and deleted)
4. plan (policies.plan, pure): serve, fill, follow, regenerate, generate alone or refuse
5. execute: a served record is a HIT; anything else is a flight of `Flights` (one fill per
   key; followers receive its chunks live), awaited until its first chunk, so errors before
   the first token are the request's. A fill re-checks the store first and, on a fleet,
   takes the key's lease: an answer stored meanwhile (here or by another replica) is a HIT
   (or COALESCED, from another replica) after all
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import assert_never

from backends.base import Backend, BackendError, DistributedLock
from cacheproxy.errors import NotCached, NotRecorded, StoreDown
from cacheproxy.keys import codec
from cacheproxy.keys.budget import SchemaBudget
from cacheproxy.keys.canonical import Parsed, Route
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.keys.key import CacheKey, make_key
from cacheproxy.runners.base import Runner
from cacheproxy.service.breaker import StoreUnavailable
from cacheproxy.service.fill import Filler, FillOrder
from cacheproxy.service.fleet import Fleet
from cacheproxy.service.flights import Flight, Flights
from cacheproxy.service.memos import BodyParser, Memos
from cacheproxy.service.parsing import ParseMemo, ParsePool
from cacheproxy.service.storage import StoreAccess
from policies.cache_control import parse_cache_control
from policies.plan import Action, Found, Lookup, Plan, Refusal, plan
from policies.sampling import SamplingMode
from policies.status import CacheStatus, Reason


@dataclass(frozen=True, slots=True)
class Stored:
    """A HIT read from the store by the full order of operations."""

    parsed: Parsed
    reason: Reason
    key: CacheKey
    fingerprint: str
    record: codec.Record
    data: bytes  # the record as the store returned it
    age: float
    serving: Fingerprint  # the very object it was keyed under (see `hold`)
    created_at: float  # of the record (provenance, typed)
    generation_ms: float  # what generating it took (0.0 when the record does not say)
    status: CacheStatus = CacheStatus.HIT


@dataclass(frozen=True, slots=True)
class Held:
    """A HIT as the service can vouch for it again (`holds`, `still_stored`): the store's
    bytes under its key, served under that very fingerprint object."""

    fingerprint: Fingerprint  # compared by `is`: a reload makes another object
    key: CacheKey
    data: bytes
    created_at: float  # of the stored record


@dataclass(frozen=True, slots=True)
class Flowing:
    """An answer that comes through a flight: generated, followed, or replayed by a fill."""

    parsed: Parsed
    status: CacheStatus
    reason: Reason
    key: CacheKey
    fingerprint: str
    flight: Flight
    stores: bool  # whether this answer is (or will be) in the store
    age: float = 0.0  # of the stored record a fill replayed


Answer = Stored | Flowing


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceOptions:
    """Knobs of the orchestration."""

    sampling: SamplingMode = SamplingMode.FORCE_GREEDY
    max_tokens_cap: int | None = None
    max_answer_tokens: int | None = None  # choices x tokens x logprob fan-out per answer
    generation_timeout: float = 300.0
    ttl: float | None = None  # entries of a pinned producer do not go stale by default
    store_retry: float = 2.0  # seconds the breaker stays open after a store failure
    lock_ttl: float = 10.0  # lease of a cross-replica fill; renewed every third of it
    replay: bool = False  # never generate: what is not stored is not_recorded
    # Under per-key scope, every tenant's saved prefix states and compiled grammars are
    # every tenant's to reuse (their reuse then tells one tenant which prompts others sent):
    # off, each its own.
    shared_prefixes: bool = False
    schema_budget: SchemaBudget = SchemaBudget()  # what one request's schemas may cost
    parse_timeout: float = 5.0  # seconds one request's schema checks may run
    parse_off_loop: bool = True  # False: expensive parses on the loop (a diagnostic)


def _not_recorded(route: Route, parsed: Parsed, key: CacheKey) -> NotRecorded:
    """The error that names the request a replaying server has no answer for."""
    request = parsed.request
    asked = request.prompt or next(
        (m.content for m in reversed(request.messages) if m.role == "user"), "")
    words = " ".join(asked.split()[:8])
    return NotRecorded(
        f"not recorded: {route} request for model {parsed.delivery.requested_model!r}, key "
        f"{key.short}, asking {words!r}{'...' if len(asked.split()) > 8 else ''}; record it "
        "by serving without --replay, or add it to the recording", request=request.wire())


def _stored(parsed: Parsed, reason: Reason, key: CacheKey, fingerprint: str,
            found: tuple[codec.Record, bytes], age: float, serving: Fingerprint) -> Stored:
    """A HIT with the times of its provenance read once, typed."""
    record, data = found
    ms = record.provenance.get("generation_ms")
    return Stored(parsed, reason, key, fingerprint, record, data, age, serving,
                  created_at=float(record.provenance.get("created_at", 0.0)),
                  generation_ms=float(ms) if isinstance(ms, int | float) else 0.0)


async def _always_open() -> None:
    return None


def _is_open() -> bool:
    return True


class CachingProxy:
    """Serve from the store, or fill it through the runner exactly once per key."""

    def __init__(
        self, runner: Runner, store: Backend, options: ServiceOptions, *,
        parsers: Mapping[Route, BodyParser],
        gate: Callable[[], Awaitable[None]] = _always_open,
        gate_open: Callable[[], bool] = _is_open, clock: Callable[[], float] = time.time,
    ) -> None:
        self.runner = runner
        self.store = store
        self.options = options
        self._gate, self._gate_open, self._clock = gate, gate_open, clock
        pool = ParsePool(timeout=options.parse_timeout) if options.parse_off_loop else None
        self.memos = Memos(parser=ParseMemo(parsers, max_tokens_cap=options.max_tokens_cap,
                                            max_answer_tokens=options.max_answer_tokens,
                                            schema_budget=options.schema_budget, pool=pool))
        self.storage = StoreAccess(store, store_retry=options.store_retry, ttl=options.ttl,
                                   decoded=self.memos.decoded)
        self.breaker = self.storage.breaker
        self._peek = self.storage.peek
        self.counters = self.storage.counters
        self.flights = Flights()
        fleet = Fleet(store, lock_ttl=options.lock_ttl, wait=options.generation_timeout) \
            if isinstance(store, DistributedLock) else None
        self._filler = Filler(runner, self.storage, fleet,
                              generation_timeout=options.generation_timeout, clock=clock)

    async def answer(self, endpoint: Route, raw: bytes, scope: str = "",
                     control: str | None = None) -> Answer:
        """Find or produce the answer to a request body (the order of operations above)."""
        parser, defaults = self.memos.parser, self.runner.defaults()
        parsed = parser.known(raw, endpoint, defaults, self.options.sampling, scope) or \
            await parser.parse_off_loop(raw, endpoint, defaults, self.options.sampling, scope)
        directives = parse_cache_control(control)
        await self._gate()  # held while the model reloads, so the key uses the new fingerprint
        serving = self.runner.fingerprint()
        fingerprint = serving.digest
        key = make_key(parsed.request, fingerprint, scope=scope)
        lookup, found = await self._look_up(key, parsed)
        the_plan = plan(parsed.sampling.decision, directives, lookup,
                        fill_running=self.flights.running(key), replay=self.options.replay)
        if isinstance(the_plan, Refusal):
            if the_plan.reason is Reason.NOT_RECORDED:
                raise _not_recorded(endpoint, parsed, key)
            if self.options.replay:  # the store is down: neither recorded nor not
                raise StoreDown(the_plan.why)
            raise NotCached(the_plan.why)
        match the_plan.action:
            case Action.SERVE:
                if found is None:
                    raise RuntimeError("a plan to serve a stored answer, without one")
                return _stored(parsed, the_plan.reason, key, fingerprint, found, lookup.age,
                               serving)
            case Action.FILL | Action.FOLLOW | Action.REGENERATE | Action.GENERATE:
                return await self._execute(the_plan, parsed, key, fingerprint,
                                           None if found is None else found[0], scope)
            case _:
                assert_never(the_plan.action)

    async def _look_up(self, key: CacheKey, parsed: Parsed
                       ) -> tuple[Lookup, tuple[codec.Record, bytes] | None]:
        if not parsed.sampling.decision.cacheable:
            return Lookup(Found.NOT_LOOKED_UP), None
        try:
            found = await self.storage.lookup(key, parsed.request)
        except StoreUnavailable:
            return Lookup(Found.STORE_DOWN), None
        if found is None:
            return Lookup(Found.NOTHING), None
        created = float(found[0].provenance.get("created_at", 0.0))
        return Lookup(Found.ENTRY, max(0.0, self._clock() - created)), found

    async def _execute(self, the_plan: Plan, parsed: Parsed, key: CacheKey, fingerprint: str,
                       previous: codec.Record | None, scope: str) -> Flowing:
        """Start (or join) the flight the plan asks for; return once it has begun. (A
        flight is per key, and a key per scope: no tenant follows another's generation.)"""
        action = the_plan.action
        shared = action in (Action.FILL, Action.FOLLOW)
        fill = self._filler.fill(FillOrder(
            request=parsed.request, fingerprint=fingerprint, store=the_plan.stores,
            recheck=shared, previous=previous if action is Action.REGENERATE else None,
            reuse_scope="" if self.options.shared_prefixes else scope))
        flight, _ = self.flights.join(key, fill, shared=shared)
        if parsed.delivery.stream:
            flight.live.start()  # so the runner delivers tokens as they come, not gathered
        await flight.started()  # errors before the first token are real HTTP errors
        status, age = the_plan.status, 0.0
        if flight.from_store:  # stored meanwhile, here or by another replica
            status = CacheStatus.COALESCED if flight.remote else CacheStatus.HIT
            age = max(0.0, self._clock() - (flight.created_at or self._clock()))
        return Flowing(parsed, status, the_plan.reason, key, fingerprint, flight,
                       the_plan.stores, age)

    def hold(self, hit: Stored) -> Held | None:
        """The HIT as the service can vouch for it again, while the fingerprint it was keyed
        under is the one serving (else None: nothing to remember)."""
        if self.runner.fingerprint() is not hit.serving:
            return None
        return Held(hit.serving, hit.key, hit.data, hit.created_at)

    def holds(self, hit: Held) -> bool:
        """Whether the full path would serve `hit` again, answered without I/O where the
        store holds the value in this process (memory, a tiered store's L1). False never
        means the HIT is gone: ask `still_stored` then. Synchronous because a coroutine costs
        ~1.5 % of a repeat HIT (callgrind)."""
        peek = self._peek
        # _serving_as_then, inlined: this is on every repeat HIT.
        if peek is None or not self._gate_open() or \
                self.runner.fingerprint() is not hit.fingerprint or not self.breaker.closed:
            return False
        try:
            return peek(hit.key) == hit.data  # bytes compare identity first
        except BackendError:  # closed: the full path says what that means
            return False

    async def still_stored(self, hit: Held) -> bool:
        """The gate is open, the runner serves that very fingerprint, the breaker is closed
        and the store returns the same bytes: the full path would give the same answer."""
        if not self._serving_as_then(hit):
            return False
        try:
            now = await self.storage.get(hit.key)
        except StoreUnavailable as exc:
            # The breaker is open now: the full path answers without the store, and counts.
            self.storage.failed("get", hit.key, exc, count=False)
            return False
        return now == hit.data

    def _serving_as_then(self, hit: Held) -> bool:
        """The conditions of a remembered HIT that need no store: no reload in progress,
        that very fingerprint serving, the store's breaker closed."""
        return self._gate_open() and self.runner.fingerprint() is hit.fingerprint and \
            self.breaker.closed

    async def aclose(self) -> None:
        """Cancel fills in progress; drop the parses not started."""
        await self.flights.aclose()
        if self.memos.parser.pool is not None:
            self.memos.parser.pool.close()
