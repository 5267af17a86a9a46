"""The service's use of the store: every call through the breaker, records checked on read.

A store failure is never an error of the request: the breaker opens and the caller hears
StoreUnavailable (a lookup) or nothing at all (a write or a delete, logged and counted).
A store that refuses a write because it is full or read-only (StoreRefused) is not down:
the breaker stays closed (its entries are still read), `put` says why the answer was not
stored, and for a few seconds no write is offered to it (each would fail, and warn).
A record that does not decode, or that holds another request than the one asking, is a
miss and is deleted.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TypeVar

import structlog

from backends.base import Backend, BackendError, Peek, StoreReadOnly, StoreRefused
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.key import CacheKey
from cacheproxy.service.breaker import Breaker, StoreUnavailable
from cacheproxy.service.memos import DecodedRecords
from policies.status import Reason

log = structlog.get_logger("cacheproxy.service")
T = TypeVar("T")
# After the store refuses a write, no write is offered to it for this long (seconds): a full
# disk seldom frees itself sooner, and each attempt costs a failing transaction. The answers
# meanwhile are refused (and counted) the same; one warning per period.
REFUSED_BACKOFF = 5.0


class StoreAccess:
    """Looks up, writes and deletes records; counts store errors and corrupt records."""

    def __init__(self, store: Backend, *, store_retry: float, ttl: float | None,
                 decoded: DecodedRecords, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.breaker = Breaker(cooldown=store_retry)
        self.counters: dict[str, int] = {"store_errors": 0, "corrupt_records": 0,
                                         "store_full": 0, "store_read_only": 0}
        self._ttl = ttl
        self._decoded = decoded
        self.peek = store.peek if isinstance(store, Peek) else None
        self._clock = clock
        self._refusal: StoreRefused | None = None  # the last refusal, and until when it holds
        self._refused_until = 0.0
        self._skipped = 0  # writes not offered since the last warning

    async def lookup(self, key: CacheKey, request: CanonicalRequest
                     ) -> tuple[codec.Record, bytes] | None:
        """The valid record under key and its stored bytes, None on a miss;
        StoreUnavailable when the store is not."""
        try:
            data = await self._read(key)
        except StoreUnavailable as exc:
            self.failed("get", key, exc)
            raise
        if data is None:
            return None
        try:
            record, packed = self._decoded.decode(key, data)
        except codec.CorruptRecord as exc:
            await self._discard(key, f"corrupt record: {exc}")
            return None
        if packed != request.packed:
            await self._discard(key, "record holds another request")
            return None
        return record, data

    async def recheck(self, key: CacheKey, request: CanonicalRequest) -> codec.Record | None:
        """A lookup just before generating: None also when the store went down meanwhile."""
        try:
            found = await self.lookup(key, request)
        except StoreUnavailable:
            return None
        return None if found is None else found[0]

    async def get(self, key: CacheKey) -> bytes | None:
        """The stored bytes; StoreUnavailable (not counted: the full path counts)."""
        return await self._read(key)

    async def put(self, key: CacheKey, record: codec.Record) -> Reason | None:
        """Store a record: None once stored, else why not (store-full, store-read-only,
        store-unavailable). A failure is logged and counted, never raised."""
        refusal = self._refusing()
        if refusal is not None:  # refused a moment ago: not offered again yet
            return self._refused(refusal)
        try:
            await self.guarded(self.store.set(key, codec.encode(record), ttl=self._ttl))
        except StoreUnavailable as exc:
            self.failed("set", key, exc)
            return Reason.STORE_UNAVAILABLE
        except StoreRefused as exc:
            self._refused_now("set", key, exc)
            return self._refused(exc)
        return None

    async def _discard(self, key: CacheKey, why: str) -> None:
        self.counters["corrupt_records"] += 1
        log.warning("record_discarded", key=key.short, why=why)
        if self._refusing() is not None:  # the record stays, and misses again
            return
        try:
            await self.guarded(self.store.delete(key))
        except StoreUnavailable as exc:
            self.failed("delete", key, exc)
        except StoreRefused as exc:
            self._refused_now("delete", key, exc)

    async def _read(self, key: CacheKey) -> bytes | None:
        """get() through the breaker; a read the store refuses (none should) is a miss."""
        try:
            return await self.guarded(self.store.get(key))
        except StoreRefused as exc:
            log.warning("store_refused", op="get", key=key.short, error=str(exc))
            return None

    def _refusing(self) -> StoreRefused | None:
        """The refusal a write would meet now: one heard less than REFUSED_BACKOFF ago."""
        if self._refusal is None or self._clock() >= self._refused_until:
            return None
        self._skipped += 1
        return self._refusal

    def _refused_now(self, op: str, key: CacheKey, exc: StoreRefused) -> None:
        """Remember a refusal for REFUSED_BACKOFF, and warn (once per period)."""
        self._refusal, self._refused_until = exc, self._clock() + REFUSED_BACKOFF
        log.warning("store_refused", op=op, key=key.short, error=str(exc),
                    skipped=self._skipped, retry_in=REFUSED_BACKOFF)
        self._skipped = 0

    def _refused(self, exc: StoreRefused) -> Reason:
        """Count an answer the store refused; the reason it shows."""
        read_only = isinstance(exc, StoreReadOnly)
        self.counters["store_read_only" if read_only else "store_full"] += 1
        return Reason.STORE_READ_ONLY if read_only else Reason.STORE_FULL

    async def guarded(self, call: Awaitable[T]) -> T:
        """Await a store call through the breaker; StoreUnavailable instead of BackendError
        (but StoreRefused, raised as it is: the store answered)."""
        try:
            self.breaker.allow()
        except StoreUnavailable:
            if isinstance(call, Coroutine):
                call.close()  # never started: no "never awaited" warning
            raise
        try:
            result = await call
        except StoreRefused:
            self.breaker.succeeded()  # up, and reading: only writes are refused
            raise
        except BackendError as exc:
            self.breaker.failed()
            raise StoreUnavailable(str(exc)) from exc
        except BaseException:
            self.breaker.abandoned()  # cancelled mid-call: neither verdict, free the probe
            raise
        self.breaker.succeeded()
        return result

    def failed(self, op: str, key: CacheKey, exc: StoreUnavailable, *, count: bool = True
               ) -> None:
        """Log (and count) a store call that failed."""
        if count:
            self.counters["store_errors"] += 1
        log.warning("store_unavailable", op=op, key=key.short, error=str(exc),
                    breaker=self.breaker.state)
