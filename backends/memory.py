"""In-process LRU store bounded by total bytes, with lazy expiry on read."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

from backends.base import (
    PURGE_BATCH,
    BackendError,
    Clock,
    PurgePause,
    StoreStatsResult,
    check_max_bytes,
    entry_size,
    expiry,
    is_expired,
)

DEFAULT_MEMORY_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Entry:
    value: bytes
    size: int
    expires_at: float | None


class MemoryBackend:
    """LRU over an OrderedDict; nothing here awaits, so each call is atomic on the loop."""

    def __init__(
        self, *, max_bytes: int = DEFAULT_MEMORY_MAX_BYTES, clock: Clock = time.time
    ) -> None:
        self._max_bytes = check_max_bytes(max_bytes)
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"MemoryBackend(max_bytes={self._max_bytes})"

    @property
    def max_bytes(self) -> int:
        """The bound on stored keys + values."""
        return self._max_bytes

    async def get(self, key: str) -> bytes | None:
        """The value, refreshing its recency; an expired entry is dropped and misses."""
        return self.peek(key)

    def peek(self, key: str) -> bytes | None:
        """get() without a coroutine: everything is held here, so None is a miss."""
        if self._closed:  # (_check_open() inlined: this is on every repeat HIT)
            raise BackendError(f"{self!r} is closed")
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at is not None and is_expired(entry.expires_at, self._clock()):
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry.value

    async def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        """Store value, evicting least recently used entries to stay under max_bytes."""
        self._check_open()
        expires_at = expiry(self._clock(), ttl)
        # The old value is stale even if the new one is too big to keep.
        self._remove(key)
        size = entry_size(key, value)
        if size > self._max_bytes:
            return
        self._entries[key] = _Entry(value, size, expires_at)
        self._bytes += size
        while self._bytes > self._max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size

    async def delete(self, key: str) -> bool:
        """Remove key; True only when the entry was present and not expired."""
        self._check_open()
        entry = self._remove(key)
        return entry is not None and not is_expired(entry.expires_at, self._clock())

    def discard(self, key: str) -> None:
        """Drop key if held, without a coroutine (for callbacks); a closed store holds none."""
        self._remove(key)

    def clear(self) -> None:
        """Drop every entry, without a coroutine."""
        self._entries.clear()
        self._bytes = 0

    async def purge_namespace(self, namespace: str, *, pause: PurgePause | None = None
                              ) -> int:
        """Delete every key starting with namespace + "/", in batches (`pause` awaited
        between two); return the count."""
        self._check_open()
        prefix = namespace + "/"
        doomed = [key for key in self._entries if key.startswith(prefix)]
        for start in range(0, len(doomed), PURGE_BATCH):
            if start and pause is not None:
                await pause()
            for key in doomed[start : start + PURGE_BATCH]:
                self._remove(key)
            await asyncio.sleep(0)  # let requests run between batches
        return len(doomed)

    async def scan(self, prefix: str, *, after: str = "", limit: int = 1000) -> list[str]:
        """Keys starting with prefix and greater than after, sorted, at most limit."""
        self._check_open()
        keys = sorted(k for k in self._entries if k.startswith(prefix) and k > after)
        return keys[:limit]

    async def namespace_stats(self, namespace: str) -> tuple[int, int]:
        """(entries, bytes) of one namespace."""
        self._check_open()
        prefix = namespace + "/"
        sizes = [e.size for k, e in self._entries.items() if k.startswith(prefix)]
        return len(sizes), sum(sizes)

    async def stats(self) -> StoreStatsResult:
        """Entries and bytes held, including expired entries not yet read."""
        self._check_open()
        return StoreStatsResult(len(self._entries), self._bytes, self._max_bytes)

    async def aclose(self) -> None:
        """Drop everything; later calls raise BackendError."""
        self._closed = True
        self._entries.clear()
        self._bytes = 0

    def _remove(self, key: str) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"{self!r} is closed")
