"""Two tiers: a small in-process LRU (L1) in front of a shared store (L2).

URL: "tiered+" then the L2 URL, with the L1 options in its query, which are taken out
before L2 is opened:

    tiered+redis://cache:6379/0?l1_max_bytes=67108864&l1_ttl=60
    tiered+redis+cluster://cache:7000?l1_max_bytes=33554432
    tiered+disk:///var/cache/cacheproxy?max_bytes=10000000000&l1_max_bytes=67108864

l1_max_bytes bounds L1 (default 64 MiB); l1_ttl (seconds, default 60) bounds how long L1
keeps any entry. Reads go L1, then L2 (filling L1 for at most l1_ttl and the entry's life
left in L2); writes go to L2 and drop the L1 copy (copied into L1 too where L2 cannot track,
below); deletes and purges go to both; key listing and the stats are L2's.

Coherence: over Redis (tiered+redis://, +rediss://, +unix://, +redis+cluster://) L1 holds
only values read while the server tracks them (RESP3 CLIENT TRACKING, Redis 6+,
backends/tracking.py): when any client changes one of those keys (writes, deletes, purges;
or the server evicts or expires it) the server pushes an invalidation and L1 drops the key,
a round trip after the change, in every replica; and an L1 copy never outlives the entry's
TTL in L2 (read with it). A replica's own writes are not copied into L1 (its next read is,
tracked). On a single server the GET connection itself is tracked; on a cluster, one
broadcasting connection per primary reports every key written there, and a primary the
cluster client has not learned of yet (a failover, a new node) is heard from once it has (at
its next read that meets the change, which then empties L1 as the new lane starts).

If a tracking connection breaks or goes silent (found within a heartbeat and three socket
timeouts), L1 goes on serving what it holds for at most l1_ttl (so hot keys survive a Redis
outage) while it reconnects in the background, and is emptied when tracking resumes; a
server slower than socket_timeout but answering within three keeps the connection and L1.
A single server tracks at most tracking-table-max-keys keys (default 1 M) across all
clients, and beyond that invalidates some early: L1 then refills more often, no staler.

Over an L2 that cannot track (disk) writes are copied into L1 too, and one replica's L1 is
not told about another replica's delete or overwrite, nor about L2 expiring or evicting an
entry it copied: it may serve that value for at most l1_ttl longer (and only while L1's LRU
keeps it). So may a Redis server that refuses to track (older than 6, or an ACL without
CLIENT: RedisBackend.tracking_refused says). For the proxy this is mostly harmless: a new
producer means a new fingerprint namespace, which makes the old entries unreachable in every
L1 at once; but a purge by hand reaches the other replicas' L1s only after l1_ttl. An L1 hit
never touches L2, so a failing L2 costs only misses.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from typing import cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from backends import listing
from backends.base import (
    Backend,
    BackendError,
    Clock,
    DistributedLock,
    Invalidations,
    NamespacePurge,
    NamespaceStats,
    PurgePause,
    Scan,
    StoreStats,
    StoreStatsResult,
    expiry,
)
from backends.memory import MemoryBackend

PREFIX = "tiered+"
DEFAULT_L1_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_L1_TTL = 60.0


class TieredBackend:
    """Read-through L1 (MemoryBackend) over any L2 Backend; write-through where L2 cannot
    track what L1 read."""

    def __init__(self, l1: MemoryBackend, l2: Backend, *, l1_ttl: float = DEFAULT_L1_TTL) -> None:
        if not math.isfinite(l1_ttl) or l1_ttl <= 0:
            raise ValueError(f"l1_ttl must be a positive number of seconds, got {l1_ttl!r}")
        self._l1 = l1
        self._l2 = l2
        self._l1_ttl = l1_ttl
        # A fill whose L2 read overlapped a change may carry the older value, so it is dropped:
        # the epoch moves on a purge or a flush; the first number of a key's _reading entry at
        # the start and end of a write or delete of that key here, and on each invalidation
        # of it (the second number counts the key's reads in flight).
        self._epoch = 0
        self._reading: dict[str, list[int]] = {}
        # A restart of tracking empties L1 but leaves the epoch: the reads then in flight go
        # out on the new, tracked connection (one answered on the old connection filled L1
        # in the loop step of its reply, before the new connection's set-up round trips).
        self.invalidations = 0  # keys L2 said changed, and flushes
        self.restarts = 0  # times tracking started on a new connection
        self._tracker = l2 if isinstance(l2, Invalidations) and \
            l2.track(self._changed, self._restarted) else None

    def __repr__(self) -> str:
        return f"TieredBackend({self._l1!r}, {self._l2!r}, l1_ttl={self._l1_ttl})"

    @property
    def coherent(self) -> bool:
        """Whether L2 can report changes to what L1 holds (see the module docstring)."""
        return self._tracker is not None

    @property
    def coherence(self) -> str:
        """For operators: "tracked", or why L1 may lag other replicas by up to l1_ttl now."""
        if self._tracker is None:
            return f"bounded by l1_ttl ({self._l2!r} cannot track keys)"
        if self._tracker.tracking_refused is not None:
            refused = self._tracker.tracking_refused
            return f"bounded by l1_ttl (the server refused to track keys: {refused})"
        return "tracked" if self._tracker.tracking else "connecting (bounded by l1_ttl)"

    @property
    def l1(self) -> MemoryBackend:
        """The in-process tier."""
        return self._l1

    @property
    def l2(self) -> Backend:
        """The shared tier."""
        return self._l2

    async def get(self, key: str) -> bytes | None:
        """L1, else L2 (copying a hit into L1 for at most l1_ttl and what L2 gives it)."""
        value = self._l1.peek(key)  # no coroutine per hit
        if value is not None:
            return value
        reading = self._reading.get(key)
        if reading is None:
            reading = self._reading[key] = [0, 0]
        reading[1] += 1
        changes, epoch = reading[0], self._epoch
        try:
            if self._tracker is not None:
                value, life = await self._tracker.get_with_ttl(key)
            else:
                value, life = await self._l2.get(key), None
        finally:
            reading[1] -= 1
            if not reading[1]:
                del self._reading[key]
        life = self._l1_ttl if life is None else min(life, self._l1_ttl)
        if value is not None and life > 0 and epoch == self._epoch and changes == reading[0]:
            await self._l1.set(key, value, life)
        return value

    def peek(self, key: str) -> bytes | None:
        """The L1 value, if any (None: ask get, which reads L2)."""
        return self._l1.peek(key)

    async def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        """Store in L2, then (unless L2 tracks reads) in L1 for at most l1_ttl."""
        expiry(0.0, ttl)  # a bad ttl changes nothing in either tier
        self._touch(key)
        self._l1.discard(key)
        try:
            await self._l2.set(key, value, ttl)
        finally:
            self._touch(key)
        tracked = self._tracker is not None and self._tracker.tracking_refused is None
        if not tracked:  # tracked: the next read copies the new value, tracked
            await self._l1.set(key, value,
                               self._l1_ttl if ttl is None else min(ttl, self._l1_ttl))

    def _changed(self, key: str | None) -> None:
        """L2 says key (None: any key) may have changed: L1 forgets it, fills in flight drop."""
        self.invalidations += 1
        if key is None:
            self._epoch += 1
            self._l1.clear()
            return
        self._l1.discard(key)
        self._touch(key)

    def _restarted(self) -> None:
        """Tracking starts on a new connection: what L1 holds is tracked no more."""
        self.restarts += 1
        self._l1.clear()

    def _touch(self, key: str) -> None:
        """Reads of key in flight must not fill L1."""
        reading = self._reading.get(key)
        if reading is not None:
            reading[0] += 1

    async def delete(self, key: str) -> bool:
        """Remove from both tiers; True when either held a live entry."""
        self._touch(key)
        try:
            in_l1 = await self._l1.delete(key)
            return await self._l2.delete(key) or in_l1
        finally:
            self._touch(key)

    async def purge_namespace(self, namespace: str, *, pause: PurgePause | None = None
                              ) -> int:
        """Purge L1, then L2 (paced by `pause`); the count is L2's."""
        self._epoch += 1
        try:
            await self._l1.purge_namespace(namespace)
            if not isinstance(self._l2, NamespacePurge):
                raise _lacks(self._l2, NamespacePurge)
            return await self._l2.purge_namespace(namespace, pause=pause)
        finally:
            self._epoch += 1

    async def scan(self, prefix: str, *, after: str = "", limit: int = 1000) -> list[str]:
        """L2's keys."""
        if not isinstance(self._l2, Scan):
            raise _lacks(self._l2, Scan)
        return await self._l2.scan(prefix, after=after, limit=limit)

    async def scan_page(self, prefix: str, *, cursor: str = "",
                        limit: int = 1000) -> tuple[list[str], str]:
        """A page of L2's keys, however L2 lists them."""
        return await listing.page(self._l2, prefix, cursor=cursor, limit=limit)

    async def random_cursor(self, prefix: str, rng: random.Random) -> str:
        """A random point of L2's listing."""
        return await listing.random_cursor(self._l2, prefix, rng)

    async def namespace_stats(self, namespace: str) -> tuple[int, int]:
        """L2's size of one namespace."""
        if not isinstance(self._l2, NamespaceStats):
            raise _lacks(self._l2, NamespaceStats)
        return await self._l2.namespace_stats(namespace)

    async def stats(self) -> StoreStatsResult:
        """L2's size and bound."""
        if not isinstance(self._l2, StoreStats):
            raise _lacks(self._l2, StoreStats)
        return await self._l2.stats()

    async def aclose(self) -> None:
        """Close both tiers (L2 even if L1 fails); idempotent."""
        results = await asyncio.gather(self._l1.aclose(), self._l2.aclose(), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result


class LockingTieredBackend(TieredBackend):
    """A tiered store over an L2 that leases (Redis): leases go straight to L2, so replicas
    on one Redis keep their cross-replica single-flight behind their L1s."""

    async def try_lock(self, name: str, owner: str, ttl: float) -> bool:
        """L2's lease."""
        return await cast(DistributedLock, self._l2).try_lock(name, owner, ttl)

    async def renew_lock(self, name: str, owner: str, ttl: float) -> bool:
        """L2's lease renewal."""
        return await cast(DistributedLock, self._l2).renew_lock(name, owner, ttl)

    async def unlock(self, name: str, owner: str) -> None:
        """L2's lease release."""
        await cast(DistributedLock, self._l2).unlock(name, owner)


def _lacks(backend: Backend, capability: type) -> BackendError:
    return BackendError(f"{backend!r} has no {capability.__name__} capability")


def open_tiered(url: str, *, clock: Clock, open_l2: Callable[[str], Backend]) -> TieredBackend:
    """A TieredBackend from a tiered+<L2 URL>; ValueError naming the URL when it is bad."""
    inner = urlsplit(url.removeprefix(PREFIX))
    if not inner.scheme or inner.scheme.startswith(PREFIX.rstrip("+")):
        raise ValueError(f"backend URL {url!r}: write tiered+<store URL>, like tiered+redis://h/0")
    params = parse_qsl(inner.query, keep_blank_values=True)
    ours = {name: raw for name, raw in params if name.startswith("l1_")}
    unknown = sorted(set(ours) - {"l1_max_bytes", "l1_ttl"})
    if unknown:
        raise ValueError(f"backend URL {url!r}: unknown parameter(s) {', '.join(unknown)}")
    if sum(name.startswith("l1_") for name, _ in params) > len(ours):
        raise ValueError(f"backend URL {url!r}: an l1_ option is given more than once")
    max_bytes = _number(url, "l1_max_bytes", ours.get("l1_max_bytes"), DEFAULT_L1_MAX_BYTES)
    l1_ttl = _number(url, "l1_ttl", ours.get("l1_ttl"), DEFAULT_L1_TTL)
    rest = urlencode([(name, raw) for name, raw in params if not name.startswith("l1_")])
    try:
        l2 = open_l2(urlunsplit(inner._replace(query=rest)))
    except ValueError as exc:
        raise ValueError(f"backend URL {url!r}: {exc}") from None
    l1 = MemoryBackend(max_bytes=int(max_bytes), clock=clock)
    kind = LockingTieredBackend if isinstance(l2, DistributedLock) else TieredBackend
    return kind(l1, l2, l1_ttl=l1_ttl)


def _number(url: str, name: str, raw: str | None, default: float) -> float:
    if raw is None:
        return default
    integral = name == "l1_max_bytes"
    try:
        value = float(int(raw)) if integral else float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        kind = "integer" if integral else "number of seconds"
        raise ValueError(f"backend URL {url!r}: {name} must be a positive {kind}, got {raw!r}")
    return value
