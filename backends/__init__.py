"""Byte-level stores, opened from a URL.

memory://?max_bytes=N, disk:///abs/dir?max_bytes=N, redis://host:port/db, rediss://…,
unix:///path/redis.sock?db=N, redis+cluster://host:port (see backends.redis_url), and
tiered+<any of those>?l1_max_bytes=N&l1_ttl=S (see backends.tiered).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlsplit, urlunsplit

import platformdirs

from backends.base import (
    Backend,
    BackendError,
    Clock,
    NamespacePurge,
    StoreStats,
    StoreStatsResult,
)
from backends.disk import DEFAULT_DISK_MAX_BYTES, DiskBackend
from backends.memory import DEFAULT_MEMORY_MAX_BYTES, MemoryBackend
from backends.tiered import PREFIX as _TIERED_PREFIX
from backends.tiered import TieredBackend, open_tiered

if TYPE_CHECKING:
    from backends.redis import RedisBackend

# The Redis stores load the redis client (~0.1 s of start-up) only when a URL names one: a
# process on memory:// or disk:// never imports it.
REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", "redis+cluster", "rediss+cluster"})

__all__ = [
    "Backend",
    "BackendError",
    "Clock",
    "DiskBackend",
    "MemoryBackend",
    "NamespacePurge",
    "RedisBackend",
    "StoreStats",
    "StoreStatsResult",
    "TieredBackend",
    "default_disk_url",
    "open_backend",
    "redact_url",
]


def open_backend(url: str, *, clock: Clock = time.time) -> Backend:
    """Build the backend a URL names; raises ValueError naming the URL when it is bad."""
    parts = urlsplit(url)
    if parts.scheme == "memory":
        if parts.netloc or parts.path not in ("", "/"):
            raise ValueError(f"backend URL {url!r}: memory takes no host or path (memory://)")
        max_bytes = _max_bytes(url, parts, DEFAULT_MEMORY_MAX_BYTES)
        return MemoryBackend(max_bytes=max_bytes, clock=clock)
    if parts.scheme == "disk":
        directory = _disk_directory(url, parts)
        max_bytes = _max_bytes(url, parts, DEFAULT_DISK_MAX_BYTES)
        return DiskBackend(directory, max_bytes=max_bytes, clock=clock)
    if parts.scheme in REDIS_SCHEMES:
        from backends.redis_url import open_redis

        return open_redis(url)  # the server keeps time: clock is not needed
    if url.startswith(_TIERED_PREFIX):
        return open_tiered(url, clock=clock, open_l2=lambda inner: open_backend(inner, clock=clock))
    raise ValueError(
        f"backend URL {url!r}: unknown scheme {parts.scheme!r}; expected memory://?max_bytes=N,"
        " disk:///absolute/dir?max_bytes=N, redis://host:port/db, rediss://…,"
        " unix:///path/redis.sock, redis+cluster://host:port, tiered+<one of those>,"
        " or jsonl:///absolute/cassette.jsonl (a recording)"
    )


if not TYPE_CHECKING:  # (mypy knows RedisBackend from above, and flags any other name)

    def __getattr__(name: str) -> object:
        if name == "RedisBackend":  # (imported when asked for: see REDIS_SCHEMES)
            from backends.redis import RedisBackend

            return RedisBackend
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def redact_url(url: str) -> str:
    """A store URL fit for logs: a password (in the authority or the query) becomes ***."""
    parts = urlsplit(url)
    secret_query = any(name.lower() in ("password", "pass") for name, _ in parse_qsl(parts.query))
    if parts.password is None and not secret_query:
        return url  # untouched: urlunsplit would also drop an empty authority ("disk:///p")
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = "&".join(
        f"{name}=***" if name.lower() in ("password", "pass") else f"{name}={value}"
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def default_disk_url() -> str:
    """The disk store under the user's cache directory, e.g. disk:///home/me/.cache/..."""
    directory = Path(platformdirs.user_cache_dir("cacheproxy")).absolute() / "store"
    return "disk://" + quote(directory.as_posix())


def _disk_directory(url: str, parts: SplitResult) -> Path:
    # disk://name/x would silently make "name" a host; insist on the three-slash form.
    path = unquote(parts.path)
    if parts.netloc or not path.startswith("/"):
        raise ValueError(
            f"backend URL {url!r}: the disk path must be absolute, written disk:///absolute/dir"
        )
    return Path(path)


def _max_bytes(url: str, parts: SplitResult, default: int) -> int:
    if parts.fragment:
        raise ValueError(f"backend URL {url!r}: unexpected fragment #{parts.fragment}")
    params = parse_qsl(parts.query, keep_blank_values=True)
    names = [name for name, _ in params]
    unknown = sorted(set(names) - {"max_bytes"})
    if unknown:
        raise ValueError(f"backend URL {url!r}: unknown parameter(s) {', '.join(unknown)}")
    if len(names) > 1:
        raise ValueError(f"backend URL {url!r}: max_bytes given more than once")
    if not params:
        return default
    raw = params[0][1]
    if not (raw.isascii() and raw.isdigit()) or int(raw) == 0:
        raise ValueError(f"backend URL {url!r}: max_bytes must be a positive integer, got {raw!r}")
    return int(raw)
