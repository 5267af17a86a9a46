"""The byte-level storage contract: a narrow Backend protocol plus optional capabilities."""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

Clock = Callable[[], float]
"""Returns the current time in float seconds; injected so tests move time by hand."""
PurgePause = Callable[[], Awaitable[object]]
"""Awaited between two steps of a purge (see NamespacePurge)."""


class BackendError(Exception):
    """A store failure (I/O, database); callers log it and treat it as a miss."""


class StoreRefused(BackendError):
    """The store refused a write but still serves what it holds: not an outage, so callers
    keep reading from it."""


class StoreFull(StoreRefused):
    """The store takes nothing new: its disk is full (which may heal)."""


class StoreReadOnly(StoreRefused):
    """The store is read-only (its directory or file system)."""


@dataclass(frozen=True, slots=True)
class StoreStatsResult:
    """What a store holds, counting entries that expired but were not yet read."""

    entries: int
    bytes: int
    max_bytes: int | None


@runtime_checkable
class Backend(Protocol):
    """Bytes in, bytes out; encoding and cache rules live above this layer."""

    async def get(self, key: str) -> bytes | None:
        """The stored value, or None when missing or expired."""

    async def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        """Store value under key; ttl is seconds from now, None means no expiry."""

    async def delete(self, key: str) -> bool:
        """Remove key; True when a live entry was removed."""

    async def aclose(self) -> None:
        """Release resources; safe to call more than once."""


@runtime_checkable
class NamespacePurge(Protocol):
    """Optional capability: drop every key of the form "<namespace>/<rest>"."""

    async def purge_namespace(self, namespace: str, *, pause: PurgePause | None = None
                              ) -> int:
        """Delete all keys starting with namespace + "/"; return how many were removed.
        A purge runs in steps; `pause`, if given, is awaited between two of them (a caller
        paces or pauses a purge with it)."""


@runtime_checkable
class Scan(Protocol):
    """Optional capability: list keys by prefix, in key order, a page at a time."""

    async def scan(self, prefix: str, *, after: str = "", limit: int = 1000) -> list[str]:
        """Keys starting with prefix and greater than after, sorted, at most limit."""


@runtime_checkable
class ScanPages(Protocol):
    """Optional capability: list keys by prefix a page at a time from a cursor, in no order
    (a store whose listing order is not the key order: Redis's SCAN). backends/listing.py
    lists any store, of this kind or of Scan's."""

    async def scan_page(self, prefix: str, *, cursor: str = "",
                        limit: int = 1000) -> tuple[list[str], str]:
        """About limit keys starting with prefix (fewer, even none, when they are sparse),
        from where cursor left off ("" = the start), and the cursor of the next page ("" at
        the end). A key present all along comes at least once; a key may come twice."""

    async def random_cursor(self, prefix: str, rng: random.Random) -> str:
        """A cursor at a random point of the listing (a sample reads pages from there)."""


@runtime_checkable
class Peek(Protocol):
    """Optional capability: a value this process holds in memory, read without I/O."""

    def peek(self, key: str) -> bytes | None:
        """The live value when it is held in this process (its recency refreshed, as get
        does); None when it is not, which says nothing about the store: ask get(). A fake
        that overrides get() to inject faults must override peek() too."""


@runtime_checkable
class Invalidations(Protocol):
    """Optional capability: the store tells this process when values it read may change."""

    def track(self, changed: Callable[[str | None], None], restarted: Callable[[], None]) -> bool:
        """From now on, call changed(key) when a value get() returned for key may have
        changed in the store (written, deleted, expired or evicted, by any client), and
        changed(None) when any may have (a flush). Call restarted() when tracking starts
        anew (a new connection): what was read before is tracked no more, and changes made
        while it was down went unheard. False when this store cannot track at all."""

    @property
    def tracking(self) -> bool:
        """Whether what get() reads now is tracked (False while reconnecting)."""

    @property
    def tracking_refused(self) -> str | None:
        """Why the server declined to track, when it did (tracking then never starts)."""

    async def get_with_ttl(self, key: str) -> tuple[bytes | None, float | None]:
        """get(), tracked, with the seconds the value has left (None: no expiry)."""


@runtime_checkable
class NamespaceStats(Protocol):
    """Optional capability: size of one namespace."""

    async def namespace_stats(self, namespace: str) -> tuple[int, int]:
        """(entries, bytes) of the keys starting with namespace + "/"."""


@runtime_checkable
class DistributedLock(Protocol):
    """Optional capability: short leases shared by every replica using the store."""

    async def try_lock(self, name: str, owner: str, ttl: float) -> bool:
        """Take the lease `name` for `owner` unless someone holds it; it expires after ttl."""

    async def renew_lock(self, name: str, owner: str, ttl: float) -> bool:
        """Extend the lease if `owner` still holds it."""

    async def unlock(self, name: str, owner: str) -> None:
        """Release the lease if `owner` still holds it."""


@runtime_checkable
class Notify(Protocol):
    """Optional capability: a wake-up call between replicas (Redis pub/sub)."""

    async def notify(self, channel: str) -> None:
        """Wake whoever waits on channel."""

    async def wait_notified(self, channel: str, within: float) -> bool:
        """Wait up to `within` seconds for a notify on channel; False when none came."""


PURGE_BATCH = 500


@runtime_checkable
class StoreStats(Protocol):
    """Optional capability: report the size of the store."""

    async def stats(self) -> StoreStatsResult:
        """Entry count, stored bytes (keys + values) and the bound."""


def entry_size(key: str, value: bytes) -> int:
    """Bytes an entry counts against max_bytes: UTF-8 key plus value."""
    return len(key.encode()) + len(value)


def expiry(now: float, ttl: float | None) -> float | None:
    """Absolute expiry time for a ttl, or None; rejects non-positive or non-finite ttl."""
    if ttl is None:
        return None
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(f"ttl must be a positive finite number of seconds or None, got {ttl!r}")
    return now + ttl


def is_expired(expires_at: float | None, now: float) -> bool:
    """True when an entry with this expiry time is dead at now."""
    return expires_at is not None and expires_at <= now


def check_max_bytes(max_bytes: int) -> int:
    """Validate a size bound; it must be a positive int."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    return max_bytes
