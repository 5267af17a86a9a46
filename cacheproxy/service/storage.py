"""The service's use of the store: every call through the breaker, records checked on read.

A store failure is never an error of the request: the breaker opens and the caller hears
StoreUnavailable (a lookup) or nothing at all (a write or a delete, logged and counted).
A store that refuses a write because it is full or read-only is not down: the breaker stays
closed (its entries are still read) and `put` says why the answer was not stored.
A record that does not decode, or that holds another request than the one asking, is a
miss and is deleted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine
from typing import TypeVar

import structlog

from backends.base import Backend, BackendError, Peek, StoreFull, StoreReadOnly
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.key import CacheKey
from cacheproxy.service.breaker import Breaker, StoreUnavailable
from cacheproxy.service.memos import DecodedRecords
from policies.status import Reason

log = structlog.get_logger("cacheproxy.service")
T = TypeVar("T")


class StoreAccess:
    """Looks up, writes and deletes records; counts store errors and corrupt records."""

    def __init__(self, store: Backend, *, store_retry: float, ttl: float | None,
                 decoded: DecodedRecords) -> None:
        self.store = store
        self.breaker = Breaker(cooldown=store_retry)
        self.counters: dict[str, int] = {"store_errors": 0, "corrupt_records": 0,
                                         "store_full": 0, "store_read_only": 0}
        self._ttl = ttl
        self._decoded = decoded
        self.peek = store.peek if isinstance(store, Peek) else None

    async def lookup(self, key: CacheKey, request: CanonicalRequest
                     ) -> tuple[codec.Record, bytes] | None:
        """The valid record under key and its stored bytes, None on a miss;
        StoreUnavailable when the store is not."""
        try:
            data = await self.guarded(self.store.get(key))
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
        return await self.guarded(self.store.get(key))

    async def put(self, key: CacheKey, record: codec.Record) -> Reason | None:
        """Store a record: None once stored, else why not (store-full, store-read-only,
        store-unavailable). A failure is logged and counted, never raised."""
        try:
            await self.guarded(self.store.set(key, codec.encode(record), ttl=self._ttl))
        except StoreUnavailable as exc:
            self.failed("set", key, exc)
            return Reason.STORE_UNAVAILABLE
        except StoreFull as exc:
            read_only = isinstance(exc, StoreReadOnly)
            self.counters["store_read_only" if read_only else "store_full"] += 1
            log.warning("store_refused", key=key.short, error=str(exc))
            return Reason.STORE_READ_ONLY if read_only else Reason.STORE_FULL
        return None

    async def _discard(self, key: CacheKey, why: str) -> None:
        self.counters["corrupt_records"] += 1
        log.warning("record_discarded", key=key.short, why=why)
        try:
            await self.guarded(self.store.delete(key))
        except StoreUnavailable as exc:
            self.failed("delete", key, exc)

    async def guarded(self, call: Awaitable[T]) -> T:
        """Await a store call through the breaker; StoreUnavailable instead of BackendError
        (but StoreFull, raised as it is: the store answered)."""
        try:
            self.breaker.allow()
        except StoreUnavailable:
            if isinstance(call, Coroutine):
                call.close()  # never started: no "never awaited" warning
            raise
        try:
            result = await call
        except StoreFull:
            self.breaker.succeeded()  # up, and reading: only new entries are refused
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
