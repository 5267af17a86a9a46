"""open_redis(url): a RedisBackend (backends/redis.py) from a URL, which is checked here.

URLs:
    redis://[user:password@]host[:port][/db]     one server over TCP (port 6379, db 0 by default)
    rediss://…                                    the same over TLS (ssl_* options pass through)
    unix:///path/to/redis.sock[?db=N]            one server over a Unix socket
    redis+cluster://host:port, rediss+cluster://… Redis Cluster, discovered from one node

Options (query): socket_timeout, socket_connect_timeout (float seconds, default 1.0) and
max_connections (default 64): at most that many commands are in flight per backend (and per
cluster node); more wait for a free slot up to the sum of both timeouts, then fail.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from backends.redis import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SOCKET_TIMEOUT,
    RedisBackend,
    TrackingFactory,
)
from backends.resp import Address, GetLane
from backends.tracking import ClusterTracking

_TLS_OPTIONS = frozenset(
    {"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"}
)


@dataclass(frozen=True)
class _Settings:
    """A URL's options, with the defaults filled in."""

    socket_timeout: float
    connect_timeout: float
    max_connections: int
    passthrough: list[tuple[str, str]]  # handed to redis-py as given (ssl_*, unix's db)

    @property
    def wait(self) -> float:
        """How long a command may wait for a free in-flight slot."""
        return self.socket_timeout + self.connect_timeout

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments of redis-py's from_url(), for a cluster or one server."""
        # One immediate retry on a broken connection heals a server restart; timeouts fail fast.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        return {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.connect_timeout,
            "max_connections": self.max_connections,
            "retry": retry,
        }


def open_redis(url: str) -> RedisBackend:
    """A RedisBackend for a redis://, rediss://, unix:// or redis+cluster:// URL.

    Raises ValueError naming the URL (password hidden) when it is malformed. Opens no
    connection: the first command connects.
    """
    parts = urlsplit(url)
    name = _redacted(url, parts)
    settings = _settings(name, parts)
    if parts.scheme.endswith("+cluster"):
        cluster, tracking = _cluster(name, parts, settings)
        return RedisBackend(cluster, name=name, max_in_flight=settings.max_connections,
                            wait=settings.wait, cluster_tracking=tracking)
    client, lane = _single(name, parts, settings)
    return RedisBackend(client, name=name, max_in_flight=settings.max_connections,
                        wait=settings.wait, lane=lane)


def _single(name: str, parts: SplitResult, settings: _Settings) -> tuple[Redis, GetLane]:
    """A client of one server, and the lane its GETs take (backends/resp.py)."""
    _check_single(name, parts)
    base = urlunsplit(parts._replace(query=urlencode(settings.passthrough), fragment=""))
    pool = ConnectionPool.from_url(base, **settings.client_options())
    kw = pool.connection_kwargs
    tls = None
    if parts.scheme == "rediss":
        tls = _tls(name, kw)
    address = Address(host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)),
                      path=kw.get("path"), db=int(kw.get("db", 0) or 0),
                      username=kw.get("username"), password=kw.get("password"), tls=tls)
    lane = GetLane(address, timeout=settings.socket_timeout,
                   connect_timeout=settings.connect_timeout)
    return Redis.from_pool(pool), lane


def _cluster(
    name: str, parts: SplitResult, settings: _Settings
) -> tuple[RedisCluster, TrackingFactory]:
    """A cluster client (discovered at its first command), and how to track its primaries."""
    base = _cluster_base(name, parts, settings.passthrough)
    cluster = RedisCluster.from_url(base, **settings.client_options())
    kw = cluster.connection_kwargs
    template = Address(username=kw.get("username"), password=kw.get("password"),
                       tls=_tls(name, {k: v for k, v in kw.items() if k.startswith("ssl_")})
                       if parts.scheme.startswith("rediss") else None)
    tracking = partial(ClusterTracking, template, timeout=settings.socket_timeout,
                       connect_timeout=settings.connect_timeout)
    return cluster, lambda heard, restarted: tracking(changed=heard, restarted=restarted)


def _settings(name: str, parts: SplitResult) -> _Settings:
    options, passthrough = _options(name, parts)
    return _Settings(
        socket_timeout=options.get("socket_timeout", DEFAULT_SOCKET_TIMEOUT),
        connect_timeout=options.get("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT),
        max_connections=int(options.get("max_connections", DEFAULT_MAX_CONNECTIONS)),
        passthrough=passthrough,
    )


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
