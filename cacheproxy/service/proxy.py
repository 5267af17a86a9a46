"""CachingProxy: the order of operations for one request.

1. The sampling policy decided (at parse time) whether the request is cacheable;
   if not: generate through the runner, store nothing            -> BYPASS; reason
2. key = make_key(canonical request, fingerprint digest)
3. store.get(key): decode, check the record's canonical request  -> HIT
   a store error is a miss (logged); a corrupt or foreign record is a miss, deleted
4. flights.join(key): one fill per key; followers                 -> COALESCED
   fill: re-check the store -> runner (one lane) -> store the record, only if the
   generation finished normally and the fingerprint did not change meanwhile -> MISS
Cache-Control request directives bend steps 3-4: a stored answer too old for max-age, or
any under no-cache, is generated again and replaced; only-if-cached never generates (504);
no-store generates without storing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TypeVar

import msgpack
import structlog

from backends.base import Backend, BackendError, DistributedLock, Peek
from cacheproxy import __version__
from cacheproxy.errors import GenerationTimeout, NotCached
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest, Parsed
from cacheproxy.keys.key import make_key
from cacheproxy.runners.base import Runner
from cacheproxy.service.breaker import Breaker, StoreUnavailable
from cacheproxy.service.fleet import Fleet
from cacheproxy.service.flights import Fill, Flight, Flights
from cacheproxy.service.memos import LRU
from policies.cache_control import NONE as NO_DIRECTIVES
from policies.cache_control import RequestDirectives, stored_answer_usable

log = structlog.get_logger("cacheproxy.service.proxy")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Answer:
    """Where an answer comes from: a stored record (HIT) or a flight (everything else)."""

    status: str
    reason: str
    key: str
    fingerprint: str
    record: codec.Record | None = None
    flight: Flight | None = None
    age: float = 0.0
    stores: bool = True  # whether this answer is (or will be) in the store
    stored: bytes | None = None  # a HIT's record as the store returned it


@dataclass(frozen=True, slots=True)
class ServiceOptions:
    """Knobs of the orchestration."""

    generation_timeout: float = 300.0
    ttl: float | None = None  # entries of a pinned producer do not go stale by default
    store_retry: float = 2.0  # seconds the breaker stays open after a store failure
    lock_ttl: float = 10.0  # lease of a cross-replica fill; renewed every third of it


async def _always_open() -> None:
    return None


def _is_open() -> bool:
    return True


class CachingProxy:
    """Serve from the store, or fill it through the runner exactly once per key."""

    def __init__(
        self,
        runner: Runner,
        store: Backend,
        options: ServiceOptions,
        *,
        gate: Callable[[], Awaitable[None]] = _always_open,
        gate_open: Callable[[], bool] = _is_open,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.runner = runner
        self._gate = gate
        self._gate_open = gate_open
        self.store = store
        self.flights = Flights()
        self._options = options
        self._clock = clock
        self.counters: dict[str, int] = {"store_errors": 0, "corrupt_records": 0}
        # Decoded records by key, reused while the store returns the same bytes.
        self._decoded: LRU[str, tuple[bytes, codec.Record, bytes]] = LRU(4096)
        self.breaker = Breaker(cooldown=options.store_retry)
        self.fleet = Fleet(store, lock_ttl=options.lock_ttl, wait=options.generation_timeout) \
            if isinstance(store, DistributedLock) else None
        self._peek = store.peek if isinstance(store, Peek) else None

    async def answer(
        self, parsed: Parsed, *, directives: RequestDirectives = NO_DIRECTIVES, scope: str = ""
    ) -> Answer:
        """Find or produce the answer to a parsed request (the order of operations above)."""
        request = parsed.request
        await self._gate()  # held while the model reloads, so the key uses the new fingerprint
        fingerprint = self.runner.fingerprint().digest
        key = make_key(request, fingerprint, scope=scope)
        decision = parsed.sampling.decision
        never_generate = directives.only_if_cached
        live = parsed.delivery.stream
        if not decision.cacheable:
            if never_generate:
                raise NotCached(f"this request is never cached ({decision.reason})")
            fill = self._fill(request, fingerprint, store=False, recheck=False)
            flight, _ = self._join(key, fill, live, shared=False)
            return Answer("BYPASS", decision.reason, key, fingerprint, flight=flight,
                          stores=False)
        try:
            found = await self._lookup(key, request)
        except StoreUnavailable:
            if never_generate:
                raise NotCached("the store is unavailable and only-if-cached was asked") from None
            # Keep answering without the store; unshared: a follower would believe it stored.
            fill = self._fill(request, fingerprint, store=False, recheck=False)
            flight, _ = self._join(key, fill, live, shared=False)
            return Answer("BYPASS", "store-unavailable", key, fingerprint, flight=flight,
                          stores=False)
        if found is not None:
            record, data = found
            age = max(0.0, self._clock() - float(record.provenance.get("created_at", 0.0)))
            fresh = stored_answer_usable(directives, age)
            if fresh.usable:
                return Answer("HIT", decision.reason, key, fingerprint, record=record, age=age,
                              stored=data)
            if never_generate:
                raise NotCached(f"the stored answer is not usable ({fresh.reason}) and "
                                "only-if-cached was asked")
            # Not usable for this request (no-cache, max-age): generate again and replace.
            fill = self._fill(request, fingerprint, store=not directives.no_store,
                              recheck=False, previous=record)
            flight, _ = self._join(key, fill, live, shared=False)
            return Answer("MISS", fresh.reason, key, fingerprint, flight=flight,
                          stores=not directives.no_store)
        if directives.only_if_cached:
            raise NotCached("no stored answer for this request, and only-if-cached was asked")
        if directives.no_store and not self.flights.running(key):
            # Lead no shared fill: followers of a fill that does not store would miss again.
            fill = self._fill(request, fingerprint, store=False, recheck=False)
            flight, _ = self._join(key, fill, live, shared=False)
            return Answer("MISS", "no-store", key, fingerprint, flight=flight, stores=False)
        fill = self._fill(request, fingerprint, store=True, recheck=True)
        flight, leader = self._join(key, fill, live)
        return Answer("MISS" if leader else "COALESCED", decision.reason, key, fingerprint,
                      flight=flight)

    def _join(self, key: str, fill: Fill, live: bool, *, shared: bool = True
              ) -> tuple[Flight, bool]:
        """Join (or lead) the flight for key; a streaming reader (`live`) says so at once,
        so the runner delivers the tokens as they come rather than gathered."""
        flight, leader = self.flights.join(key, fill, shared=shared)
        if live:
            flight.live.start()
        return flight, leader

    def _serving_as_then(self, fingerprint: object) -> bool:
        """The conditions of a remembered HIT that need no store: no reload in progress,
        that very fingerprint serving, the store's breaker closed."""
        return self._gate_open() and self.runner.fingerprint() is fingerprint and \
            self.breaker.closed

    def still_held(self, key: str, data: bytes, fingerprint: object) -> bool:
        """still_stored() answered without I/O, where the store holds the value in this
        process (memory, a tiered store's L1): True when it holds. False never means the
        HIT is gone: ask still_stored then."""
        if self._peek is None or not self._serving_as_then(fingerprint):
            return False
        try:
            now = self._peek(key)
        except BackendError:  # closed: the full path says what that means
            return False
        return now is data or now == data  # equal: read back into an L1, say

    async def still_stored(self, key: str, data: bytes, fingerprint: object) -> bool:
        """Whether an earlier HIT still holds for a repeat of its request, so that the full
        order of operations would give the same answer: the gate is open, the runner serves
        that very fingerprint, the breaker is closed and the store returns the same bytes."""
        if not self._serving_as_then(fingerprint):
            return False
        try:
            now = await self._guarded(self.store.get(key))
        except StoreUnavailable as exc:
            # The breaker is open now: the full path answers without the store, and counts.
            self._store_failed("get", key, exc, count=False)
            return False
        return now is data or now == data

    async def _lookup(self, key: str, request: CanonicalRequest
                      ) -> tuple[codec.Record, bytes] | None:
        """The valid record under key and its stored bytes, None on a miss;
        StoreUnavailable when the store is not."""
        try:
            data = await self._guarded(self.store.get(key))
        except StoreUnavailable as exc:
            self._store_failed("get", key, exc)
            raise
        if data is None:
            return None
        known = self._decoded.get(key)
        if known is not None and (known[0] is data or known[0] == data):
            record, packed = known[1], known[2]  # the same stored bytes: decoded before
        else:
            try:
                record = codec.decode(data)
            except codec.CorruptRecord as exc:
                await self._discard(key, f"corrupt record: {exc}")
                return None
            packed = msgpack.packb(record.request, use_bin_type=True)
            # A decoded record takes a few times its encoded size in memory.
            self._decoded.put(key, (data, record, packed), size=4 * len(data))
        if packed != request.packed:
            await self._discard(key, "record holds another request")
            return None
        return record, data

    async def _discard(self, key: str, why: str) -> None:
        self.counters["corrupt_records"] += 1
        log.warning("record_discarded", key=key[:16], why=why)
        try:
            await self._guarded(self.store.delete(key))
        except StoreUnavailable as exc:
            self._store_failed("delete", key, exc)

    async def _guarded(self, call: Awaitable[T]) -> T:
        """Await a store call through the breaker; StoreUnavailable instead of BackendError."""
        try:
            self.breaker.allow()
        except StoreUnavailable:
            if isinstance(call, Coroutine):
                call.close()  # never started: no "never awaited" warning
            raise
        try:
            result = await call
        except BackendError as exc:
            self.breaker.failed()
            raise StoreUnavailable(str(exc)) from exc
        except BaseException:
            self.breaker.abandoned()  # cancelled mid-call: neither verdict, free the probe
            raise
        self.breaker.succeeded()
        return result

    def _store_failed(self, op: str, key: str, exc: StoreUnavailable, *, count: bool = True
                      ) -> None:
        if count:
            self.counters["store_errors"] += 1
        log.warning("store_unavailable", op=op, key=key[:16], error=str(exc),
                    breaker=self.breaker.state)

    def _fill(
        self, request: CanonicalRequest, fingerprint: str, *, store: bool, recheck: bool,
        previous: codec.Record | None = None,
    ) -> Fill:
        async def fill(flight: Flight) -> None:
            if recheck and (record := await self._recheck(flight.key, request)) is not None:
                # Filled by a flight that finished between our lookup and our join.
                _replay(flight, record)
                return
            lease = None
            # A regeneration (previous set) must not be answered by the record it replaces.
            if store and self.fleet is not None and previous is None:
                got = await self.fleet.lead_or_follow(
                    flight.key, lambda: self._recheck(flight.key, request))
                if isinstance(got, codec.Record):  # another replica generated it
                    flight.remote = True
                    _replay(flight, got)
                    return
                lease = got
            try:
                await self._generate(flight, request, fingerprint, store, previous)
            finally:
                if lease is not None:
                    await lease.release()

        return fill

    async def _generate(self, flight: Flight, request: CanonicalRequest, fingerprint: str,
                        store: bool, previous: codec.Record | None) -> None:
        """Run the generation on the lane, publish it live, store it if it may be stored."""
        started = time.monotonic()
        generation = self.runner.generate(request)
        flight.live.when(generation.live.start)
        try:
            async with asyncio.timeout(self._options.generation_timeout):
                output = await generation.relay(flight.publish)
        except TimeoutError:
            generation.cancel()
            raise GenerationTimeout(
                f"generation exceeded {self._options.generation_timeout:g} s"
            ) from None
        except asyncio.CancelledError:
            generation.cancel()
            raise
        flight.generation_ms = (time.monotonic() - started) * 1000
        if previous is not None:
            same = previous.output.token_ids == output.token_ids and \
                previous.output.text == output.text
            flight.revalidated = "match" if same else "mismatch"
        # Stored only under the producer it was keyed for: the model that ran it (a reload
        # between the key and the lane) and the one serving now (a change meanwhile).
        ran_on = generation.produced_by
        unchanged = self.runner.fingerprint().digest == fingerprint and \
            ran_on in (None, fingerprint)
        if store and unchanged and output.finish_reason in ("stop", "length"):
            record = self._record(request, output, flight.generation_ms)
            await self._store(flight.key, record)
        flight.finish(output)

    async def _recheck(self, key: str, request: CanonicalRequest) -> codec.Record | None:
        try:
            found = await self._lookup(key, request)
        except StoreUnavailable:
            return None  # went down since the lookup: generate anyway
        return None if found is None else found[0]

    def _record(self, request: CanonicalRequest, output: codec.Output, ms: float) -> codec.Record:
        fp = self.runner.fingerprint()
        provenance = {
            "fingerprint": fp.digest,
            "fingerprint_fields": fp.fields(),
            "created_at": self._clock(),
            "generation_ms": round(ms, 3),
            "proxy_version": __version__,
            "lane": "batch-of-one, cold prefill",
        }
        return codec.Record(request=request.wire(), output=output, provenance=provenance)

    async def _store(self, key: str, record: codec.Record) -> None:
        data = codec.encode(record)
        try:
            await self._guarded(self.store.set(key, data, ttl=self._options.ttl))
        except StoreUnavailable as exc:
            self._store_failed("set", key, exc)

    async def aclose(self) -> None:
        """Cancel fills in progress."""
        await self.flights.aclose()


def _replay(flight: Flight, record: codec.Record) -> None:
    """Publish a stored answer on a flight, chunk by chunk, as it was generated."""
    flight.created_at = float(record.provenance.get("created_at", 0.0))
    for chunk in record.output.chunks:
        flight.publish(chunk)
    flight.finish(record.output, from_store=True)
