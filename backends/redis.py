"""Redis (or Valkey) store on redis.asyncio: one server, or a Redis Cluster.

open_redis (backends/redis_url.py) opens one from a URL; purge, key listing (scan_page) and
stats, which visit every primary, are in backends/redis_keyspace.py. Expiry is the server's
own (SET ... PX).

GETs of a single server (redis://, rediss://, unix://) are pipelined on one connection of
their own (backends/resp.py; over TLS with the SSL context redis-py builds from the same URL):
the hit path's only call, at a fifth of redis-py's CPU per GET. On that
connection the server can also track the keys read and report their changes (`track`,
backends/tracking.py; on a cluster, one broadcasting connection per primary), which keeps the
tiered store's L1 coherent across replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Callable
from types import TracebackType

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError

from backends import redis_keyspace
from backends.base import BackendError, PurgePause, StoreFull, StoreStatsResult, expiry
from backends.redis_keyspace import Client
from backends.resp import GetLane, LaneError
from backends.tracking import ClusterTracking, Listener, TrackedLane

DEFAULT_SOCKET_TIMEOUT = 1.0
DEFAULT_MAX_CONNECTIONS = 64
# How RedisBackend starts tracking a cluster's primaries, given changed() and restarted().
TrackingFactory = Callable[[Listener, Callable[[], None]], ClusterTracking]

# TimeoutError is an OSError; RedisClusterException is not a RedisError.
_FAILURES = (RedisError, RedisClusterException, OSError)
# Compare-and-act on a lease, atomically: only its owner extends or releases it.
_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
          "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
_UNLOCK = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
           "return redis.call('del', KEYS[1]) else return 0 end")


class RedisBackend:
    """A Backend over one redis.asyncio client; every failure surfaces as BackendError."""

    def __init__(self, client: Client, *, name: str, max_in_flight: int = DEFAULT_MAX_CONNECTIONS,
                 wait: float = 2 * DEFAULT_SOCKET_TIMEOUT, lane: GetLane | None = None,
                 cluster_tracking: TrackingFactory | None = None) -> None:
        self._client = client
        self._lane = lane  # GETs of a single server over TCP or Unix socket (see resp.py)
        self._cluster_tracking_for = cluster_tracking  # how to track a cluster's primaries
        self._cluster_tracking: ClusterTracking | None = None
        self._name = name
        self._wait = wait
        # Both clients' pools raise when exhausted; callers queue here instead. (redis-py's
        # BlockingConnectionPool would queue too, but costs ~10 us more on every GET.)
        self._gate = asyncio.Semaphore(max_in_flight)
        # redis-py 8.1's RedisCluster breaks connections of commands that run while it
        # discovers the cluster, so the first caller discovers it alone (the rest wait).
        self._discovered = not isinstance(client, RedisCluster)
        self._discovering = asyncio.Lock()
        self._closed = False
        self._purge_lanes: set[GetLane] = set()  # purges in progress, each on its own lane
        self._guard = _Guard(self)

    def __repr__(self) -> str:
        return f"RedisBackend({self._name!r})"

    async def get(self, key: str) -> bytes | None:
        """The value, or None; one GET round trip."""
        if self._lane is not None:
            self._check_open()
            try:
                return await self._lane.get(key)
            except LaneError as exc:
                raise BackendError(f"{self!r}: {exc}") from exc
        async with self._guard:
            value = await self._client.get(key)
        return _as_bytes(value)

    def track(self, changed: Callable[[str | None], None], restarted: Callable[[], None]) -> bool:
        """Invalidations for the keys get_with_ttl() reads (backends/tracking.py): on the GET
        lane of a single server; over a cluster, every key written on any primary (its
        tracking starting anew counts as changed(None), not restarted())."""

        def heard(key: bytes | None) -> None:
            changed(None if key is None else key.decode("utf-8", "surrogateescape"))

        if self._lane is not None:
            lane, self._lane = self._lane, TrackedLane.like(self._lane, changed=heard,
                                                             restarted=restarted)
            lane.close()
            return True
        if self._cluster_tracking_for is not None:
            if self._cluster_tracking is not None:
                self._cluster_tracking.close()
            self._cluster_tracking = self._cluster_tracking_for(heard, restarted)
            return True
        return False

    def _watch_primaries(self) -> None:
        """Keep a tracked lane to every primary the cluster client knows now."""
        if self._cluster_tracking is not None and isinstance(self._client, RedisCluster):
            self._cluster_tracking.watch(
                [(node.host, int(node.port)) for node in self._client.get_primaries()])

    @property
    def tracking(self) -> bool:
        """Whether the server tracks what get_with_ttl() reads now."""
        if self._cluster_tracking is not None:
            return self._cluster_tracking.tracking
        return isinstance(self._lane, TrackedLane) and self._lane.tracking

    @property
    def tracking_refused(self) -> str | None:
        """The server's answer when it refused to track keys (Redis < 6, or an ACL)."""
        if self._cluster_tracking is not None:
            return self._cluster_tracking.refused
        return self._lane.refused if isinstance(self._lane, TrackedLane) else None

    async def get_with_ttl(self, key: str) -> tuple[bytes | None, float | None]:
        """The value and the seconds it has left (None: no expiry), read in one round trip."""
        if self._lane is not None:
            self._check_open()
            try:
                value, pttl = await self._lane.get_with_pttl(key)
            except LaneError as exc:
                raise BackendError(f"{self!r}: {exc}") from exc
        else:
            async with self._guard:
                self._watch_primaries()
                pipe = self._client.pipeline(transaction=False)
                pipe.get(key)
                pipe.pttl(key)
                try:
                    raw, pttl = await pipe.execute()
                finally:  # a primary learned during the read (MOVED) is tracked from now on
                    self._watch_primaries()
            value = _as_bytes(raw)
        if value is None or pttl == -1:
            return value, None
        return value, max(pttl, 0) / 1000  # -2: deleted since the GET, so nothing left

    async def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        """SET with PX milliseconds (rounded up) when ttl is given."""
        px = _milliseconds(ttl)
        async with self._guard:
            await self._client.set(key, value, px=px)

    async def delete(self, key: str) -> bool:
        """UNLINK key; True when it existed and had not expired."""
        async with self._guard:
            removed = await self._client.execute_command("UNLINK", key)
        return bool(removed)

    async def try_lock(self, name: str, owner: str, ttl: float) -> bool:
        """SET name owner NX PX ttl."""
        async with self._guard:
            return bool(await self._client.set(name, owner, nx=True, px=_milliseconds(ttl)))

    async def renew_lock(self, name: str, owner: str, ttl: float) -> bool:
        """PEXPIRE name, only while owner holds it (one atomic script)."""
        async with self._guard:
            renewed = await self._client.eval(_RENEW, 1, name, owner, str(_milliseconds(ttl)))
        return bool(renewed)

    async def unlock(self, name: str, owner: str) -> None:
        """DEL name, only while owner holds it (one atomic script)."""
        async with self._guard:
            await self._client.eval(_UNLOCK, 1, name, owner)

    async def notify(self, channel: str) -> None:
        """PUBLISH on channel (a cluster has no pub/sub here: waiters poll instead)."""
        if isinstance(self._client, RedisCluster):
            return
        async with self._guard:
            await self._client.publish(channel, b"1")

    async def wait_notified(self, channel: str, within: float) -> bool:
        """SUBSCRIBE and wait for one message, at most `within` seconds."""
        if isinstance(self._client, RedisCluster):
            await asyncio.sleep(within)
            return False
        pubsub = self._client.pubsub()
        try:
            async with self._guard:
                await pubsub.subscribe(channel)
            deadline = asyncio.get_running_loop().time() + within
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
                if message is not None:
                    return True
            return False
        except _FAILURES as exc:
            raise BackendError(f"{self!r}: {type(exc).__name__}: {exc}") from exc
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def purge_namespace(self, namespace: str, *, pause: PurgePause | None = None
                              ) -> int:
        """SCAN "<namespace>/*" on every primary and UNLINK in small, paced steps (on a
        single server, on a connection of the purge's own); return the count."""
        async with self._guard:
            if self._lane is None:
                return await redis_keyspace.purge_namespace(self._client, namespace,
                                                            pause=pause)
            lane = self._lane.sibling()
            self._purge_lanes.add(lane)  # (closed by aclose too: a purge ends with its store)
            try:
                return await redis_keyspace.purge_on_lane(lane, namespace, pause=pause)
            except LaneError as exc:
                raise BackendError(f"{self!r}: {exc}") from exc
            finally:
                self._purge_lanes.discard(lane)
                lane.close()

    async def scan_page(self, prefix: str, *, cursor: str = "",
                        limit: int = 1000) -> tuple[list[str], str]:
        """About limit keys starting with prefix, from a SCAN cursor; the next cursor."""
        async with self._guard:
            return await redis_keyspace.scan_page(self._client, prefix, cursor=cursor,
                                                  limit=limit)

    async def random_cursor(self, prefix: str, rng: random.Random) -> str:
        """A SCAN cursor at a random point of the keyspace."""
        async with self._guard:
            return redis_keyspace.random_cursor(self._client, rng)

    async def namespace_stats(self, namespace: str) -> tuple[int, int]:
        """(entries, key + value bytes) of one namespace, by SCAN and pipelined STRLEN."""
        async with self._guard:
            return await redis_keyspace.namespace_stats(self._client, namespace)

    async def stats(self) -> StoreStatsResult:
        """DBSIZE entries and used_memory bytes, summed over primaries; maxmemory or None."""
        async with self._guard:
            return await redis_keyspace.stats(self._client)

    async def aclose(self) -> None:
        """Close every connection; later calls raise BackendError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._lane is not None:
            self._lane.close()
        for lane in list(self._purge_lanes):
            lane.close()
        if self._cluster_tracking is not None:
            self._cluster_tracking.close()
        with contextlib.suppress(*_FAILURES):  # nothing left to release on a dead connection
            await self._client.aclose()

    async def _discover(self) -> None:
        async with self._discovering:
            if self._discovered or not isinstance(self._client, RedisCluster):
                return
            try:
                await self._client.initialize()
            except _FAILURES as exc:
                raise BackendError(f"{self!r}: {type(exc).__name__}: {exc}") from exc
            self._discovered = True

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"{self!r} is closed")


class _Guard:
    """Refuses calls after close, takes an in-flight slot, turns failures into BackendError."""

    __slots__ = ("_backend",)

    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend

    async def __aenter__(self) -> None:
        backend = self._backend
        backend._check_open()
        if not backend._discovered:
            await backend._discover()
        gate = backend._gate
        if not gate.locked():
            await gate.acquire()  # free slot: returns without suspending
            return
        try:
            async with asyncio.timeout(backend._wait):
                await gate.acquire()
        except TimeoutError as exc:
            raise BackendError(f"{backend!r}: no free connection within {backend._wait}s") from exc

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        backend = self._backend
        backend._gate.release()
        if isinstance(exc, OutOfMemoryError):  # maxmemory reached with nothing to evict
            raise StoreFull(f"{backend!r}: {exc}") from exc
        if isinstance(exc, _FAILURES):
            raise BackendError(f"{backend!r}: {type(exc).__name__}: {exc}") from exc


def _milliseconds(ttl: float | None) -> int | None:
    """PX for a ttl in seconds, never 0; ValueError for a bad ttl (as every backend)."""
    if expiry(0.0, ttl) is None or ttl is None:
        return None
    return max(1, math.ceil(ttl * 1000))


def _as_bytes(value: object) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    raise BackendError(f"expected bytes from Redis, got {type(value).__name__}")
