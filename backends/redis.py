"""Redis (or Valkey) store on redis.asyncio: one server, or a Redis Cluster.

URLs:
    redis://[user:password@]host[:port][/db]     one server over TCP (port 6379, db 0 by default)
    rediss://…                                    the same over TLS (ssl_* options pass through)
    unix:///path/to/redis.sock[?db=N]            one server over a Unix socket
    redis+cluster://host:port, rediss+cluster://… Redis Cluster, discovered from one node

Options (query): socket_timeout, socket_connect_timeout (float seconds, default 1.0) and
max_connections (default 64): at most that many commands are in flight per backend (and per
cluster node); more wait for a free slot up to the sum of both timeouts, then fail.

GETs of a single server (redis://, rediss://, unix://) are pipelined on one connection of
their own (backends/resp.py; over TLS with the SSL context redis-py builds from the same URL):
the hit path's only call, at a fifth of redis-py's CPU per GET. On that
connection the server can also track the keys read and report their changes (`track`,
backends/tracking.py; on a cluster, one broadcasting connection per primary), which keeps the
tiered store's L1 coherent across replicas.

Expiry is the server's own (SET ... PX), evictions are the server's maxmemory policy, so
max_bytes here is whatever maxmemory says. Every key is a single-key command, so keys need
no hash tags on a cluster; only purge/scan/stats visit every primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from functools import partial
from types import TracebackType
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from backends.base import PURGE_BATCH, BackendError, StoreStatsResult, expiry
from backends.resp import Address, GetLane, LaneError
from backends.tracking import ClusterTracking, Listener, TrackedLane

DEFAULT_SOCKET_TIMEOUT = 1.0
DEFAULT_MAX_CONNECTIONS = 64
SCHEMES = frozenset({"redis", "rediss", "unix", "redis+cluster", "rediss+cluster"})
_SCAN_COUNT = 1000
_TLS_OPTIONS = frozenset(
    {"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"}
)
# TimeoutError is an OSError; RedisClusterException is not a RedisError.
_FAILURES = (RedisError, RedisClusterException, OSError)

Client = Redis | RedisCluster
# Compare-and-act on a lease, atomically: only its owner extends or releases it.
_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
          "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
_UNLOCK = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
           "return redis.call('del', KEYS[1]) else return 0 end")


class RedisBackend:
    """A Backend over one redis.asyncio client; every failure surfaces as BackendError."""

    def __init__(
        self,
        client: Client,
        *,
        name: str,
        max_in_flight: int = DEFAULT_MAX_CONNECTIONS,
        wait: float = 2 * DEFAULT_SOCKET_TIMEOUT,
        lane: GetLane | None = None,
        cluster_tracking: Callable[[Listener, Callable[[], None]], ClusterTracking] | None = None,
    ) -> None:
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
            renewed = await self._client.eval(
                _RENEW, 1, name, owner, str(_milliseconds(ttl)))
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

    async def purge_namespace(self, namespace: str) -> int:
        """SCAN "<namespace>/*" on every primary and UNLINK in batches; return the count."""
        removed = 0
        async with self._guard:
            async for batch in self._batches(_glob_escape(namespace) + "/*"):
                # On a cluster, unlink() splits the batch by slot into one pipeline.
                removed += int(await self._client.unlink(*batch))
        return removed

    async def scan(self, prefix: str, *, after: str = "", limit: int = 1000) -> list[str]:
        """Keys starting with prefix and greater than after, sorted, at most limit."""
        keys: set[str] = set()
        async with self._guard:
            async for batch in self._batches(_glob_escape(prefix) + "*"):
                keys.update(k.decode(errors="replace") for k in batch)
        return sorted(k for k in keys if k > after)[:limit]

    async def namespace_stats(self, namespace: str) -> tuple[int, int]:
        """(entries, key + value bytes) of one namespace, by SCAN and pipelined STRLEN."""
        entries = total = 0
        async with self._guard:
            async for batch in self._batches(_glob_escape(namespace) + "/*"):
                pipe = self._client.pipeline(transaction=False)
                for key in batch:
                    pipe.strlen(key)
                # A key that expires between SCAN and STRLEN counts with 0 value bytes.
                lengths = await pipe.execute()
                entries += len(batch)
                total += sum(len(k) for k in batch) + sum(int(n) for n in lengths)
        return entries, total

    async def stats(self) -> StoreStatsResult:
        """DBSIZE entries and used_memory bytes, summed over primaries; maxmemory or None."""
        async with self._guard:
            sizes = await self._on_primaries("DBSIZE")
            infos = await self._on_primaries("INFO", "memory")
        bounds = [int(info.get("maxmemory", 0)) for info in infos]
        return StoreStatsResult(
            entries=sum(int(size) for size in sizes),
            bytes=sum(int(info["used_memory"]) for info in infos),
            max_bytes=sum(bounds) if all(bounds) else None,
        )

    async def aclose(self) -> None:
        """Close every connection; later calls raise BackendError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._lane is not None:
            self._lane.close()
        if self._cluster_tracking is not None:
            self._cluster_tracking.close()
        with contextlib.suppress(*_FAILURES):  # nothing left to release on a dead connection
            await self._client.aclose()

    async def _batches(self, pattern: str) -> AsyncIterator[list[bytes]]:
        """Distinct-enough batches of keys matching pattern (SCAN may repeat a key)."""
        batch: list[bytes] = []
        async for key in self._client.scan_iter(match=pattern, count=_SCAN_COUNT):
            batch.append(key)
            if len(batch) >= PURGE_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    async def _discover(self) -> None:
        async with self._discovering:
            if self._discovered or not isinstance(self._client, RedisCluster):
                return
            try:
                await self._client.initialize()
            except _FAILURES as exc:
                raise BackendError(f"{self!r}: {type(exc).__name__}: {exc}") from exc
            self._discovered = True

    async def _on_primaries(self, *args: str) -> list[Any]:
        if isinstance(self._client, RedisCluster):
            return [
                await self._client.execute_command(*args, target_nodes=node)
                for node in self._client.get_primaries()
            ]
        return [await self._client.execute_command(*args)]  # type: ignore[no-untyped-call]

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


def _glob_escape(text: str) -> str:
    """text as a literal inside a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def open_redis(url: str) -> RedisBackend:
    """A RedisBackend for a redis://, rediss://, unix:// or redis+cluster:// URL.

    Raises ValueError naming the URL (password hidden) when it is malformed. Opens no
    connection: the first command connects.
    """
    parts = urlsplit(url)
    name = _redacted(url, parts)
    options, passthrough = _options(name, parts)
    socket_timeout = options.get("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
    connect_timeout = options.get("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
    max_connections = int(options.get("max_connections", DEFAULT_MAX_CONNECTIONS))
    wait = socket_timeout + connect_timeout
    # One immediate retry on a broken connection heals a server restart; timeouts fail fast.
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "max_connections": max_connections,
        "retry": retry,
    }
    if parts.scheme.endswith("+cluster"):
        cluster = RedisCluster.from_url(_cluster_base(name, parts, passthrough), **common)
        kw = cluster.connection_kwargs
        template = Address(username=kw.get("username"), password=kw.get("password"),
                           tls=_tls(name, {k: v for k, v in kw.items() if k.startswith("ssl_")})
                           if parts.scheme.startswith("rediss") else None)
        tracking = partial(ClusterTracking, template, timeout=socket_timeout,
                           connect_timeout=connect_timeout)
        return RedisBackend(cluster, name=name, max_in_flight=max_connections, wait=wait,
                            cluster_tracking=lambda heard, restarted: tracking(
                                changed=heard, restarted=restarted))
    _check_single(name, parts)
    base = urlunsplit(parts._replace(query=urlencode(passthrough), fragment=""))
    pool = ConnectionPool.from_url(base, **common)
    kw = pool.connection_kwargs
    tls = None
    if parts.scheme == "rediss":
        tls = _tls(name, kw)
    address = Address(host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)),
                      path=kw.get("path"), db=int(kw.get("db", 0) or 0),
                      username=kw.get("username"), password=kw.get("password"), tls=tls)
    lane = GetLane(address, timeout=socket_timeout, connect_timeout=connect_timeout)
    return RedisBackend(Redis.from_pool(pool), name=name, max_in_flight=max_connections,
                        wait=wait, lane=lane)


def _tls(name: str, kwargs: dict[str, Any]) -> ssl.SSLContext:
    """The very SSL context redis-py's own connections build from these arguments."""
    try:
        return SSLConnection(**kwargs).ssl_context.get()
    except (OSError, ssl.SSLError, RedisError) as exc:
        raise ValueError(f"backend URL {name!r}: TLS set-up failed: {exc}") from None


def _options(name: str, parts: SplitResult) -> tuple[dict[str, float], list[tuple[str, str]]]:
    if parts.fragment:
        raise ValueError(f"backend URL {name!r}: unexpected fragment #{parts.fragment}")
    allowed = {"socket_timeout", "socket_connect_timeout", "max_connections"}
    passthrough_names = set(_TLS_OPTIONS) if parts.scheme.startswith("rediss") else set()
    if parts.scheme == "unix":
        passthrough_names.add("db")
    params = parse_qsl(parts.query, keep_blank_values=True)
    names = [n for n, _ in params]
    unknown = sorted(set(names) - allowed - passthrough_names)
    if unknown:
        raise ValueError(f"backend URL {name!r}: unknown parameter(s) {', '.join(unknown)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"backend URL {name!r}: {', '.join(repeated)} given more than once")
    options = {n: _positive(name, n, raw) for n, raw in params if n in allowed}
    passthrough = [(n, raw) for n, raw in params if n in passthrough_names]
    if parts.scheme == "unix" and "db" in dict(passthrough):
        _positive(name, "db", dict(passthrough)["db"], zero_ok=True)
    return options, passthrough


def _positive(name: str, option: str, raw: str, *, zero_ok: bool = False) -> float:
    integral = option in ("max_connections", "db")
    try:
        value = float(int(raw)) if integral else float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        kind = "integer" if integral else "number of seconds"
        raise ValueError(f"backend URL {name!r}: {option} must be a positive {kind}, got {raw!r}")
    return value


def _check_single(name: str, parts: SplitResult) -> None:
    if parts.scheme == "unix":
        if parts.netloc or not parts.path.startswith("/"):
            raise ValueError(f"backend URL {name!r}: write unix:///absolute/path/to/redis.sock")
        return
    _check_host(name, parts)
    db = parts.path.lstrip("/")
    if parts.path not in ("", "/") and not (db.isascii() and db.isdigit()):
        raise ValueError(f"backend URL {name!r}: the path must be a database number, like /0")


def _cluster_base(name: str, parts: SplitResult, passthrough: Iterable[tuple[str, str]]) -> str:
    _check_host(name, parts)
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"backend URL {name!r}: a cluster has only database 0")
    scheme = parts.scheme.removesuffix("+cluster")
    return urlunsplit((scheme, parts.netloc, "", urlencode(list(passthrough)), ""))


def _check_host(name: str, parts: SplitResult) -> None:
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"backend URL {name!r}: bad port") from None
    if not parts.hostname:
        raise ValueError(f"backend URL {name!r}: a host is required, like redis://host:6379/0")


def _redacted(url: str, parts: SplitResult) -> str:
    """The URL with its password replaced by ***, safe for logs and error messages."""
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
