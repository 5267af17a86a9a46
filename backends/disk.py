"""Persistent LRU store in SQLite (WAL), run on one dedicated worker thread."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import structlog

from backends.base import (
    PURGE_BATCH,
    BackendError,
    Clock,
    PurgePause,
    StoreFull,
    StoreReadOnly,
    StoreRefused,
    StoreStatsResult,
    check_max_bytes,
    entry_size,
    expiry,
    is_expired,
)
from backends.disk_frozen import Watch, abandon
from backends.disk_open import BUSY_TIMEOUT_S as _BUSY_TIMEOUT_S
from backends.disk_open import DB_FILENAME as DB_FILENAME  # (named here by tests and tools)
from backends.disk_open import (
    PAGE_CACHE_KIB,
    corrupt,
    open_database,
    open_writable,
    quarantine,
    store_error,
    too_full,
)
from backends.disk_open import transaction as _transaction
from backends.disk_purger import Purger
from backends.disk_purger import bounds as _bounds
from backends.disk_recency import Recencies
from backends.disk_recency import write as _write_recencies

log = structlog.get_logger("cacheproxy.store.disk")
DEFAULT_DISK_MAX_BYTES = 1024 * 1024 * 1024
# seconds: a read refreshes an entry's recency at most this often (never by writing:
# backends/disk_recency.py writes them in batches, off the store's thread)
TOUCH_EVERY = 1.0
# A store opened read-only on a full disk tries to open it writable again, on a write, at
# most this often (seconds of its clock): it heals once there is room, at little cost.
WRITABLE_RETRY = 5.0
_EVICT_BATCH = 64

_T = TypeVar("_T")


class DiskBackend:
    """SQLite store; every database call runs on the backend's single worker thread."""

    def __init__(
        self,
        directory: str | Path,
        *,
        max_bytes: int = DEFAULT_DISK_MAX_BYTES,
        clock: Clock = time.time,
    ) -> None:
        self._directory = Path(directory)
        if not self._directory.is_absolute():
            raise ValueError(f"disk store directory must be absolute, got {str(directory)!r}")
        self._max_bytes = check_max_bytes(max_bytes)
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheproxy-disk")
        self._recencies = Recencies(self._directory / DB_FILENAME)
        self._purgers: set[Purger] = set()  # the purges' child processes, while they run
        # Touched only on the worker thread; opened lazily so construction never blocks.
        self._conn: sqlite3.Connection | None = None
        self._watch = Watch(self._directory / DB_FILENAME)  # its files, frozen or truncated
        self._broken = ""  # why its files may not be touched now (logged once)
        self._bytes = 0
        self._data_version: int | None = None
        self._closed = False
        self._close_done: asyncio.Future[None] | None = None
        self.quarantined: list[Path] = []  # corrupt database files moved aside
        self._refusing: type[StoreRefused] | None = None  # opened read-only: what a write is
        self._writable_retry_at = 0.0  # (opened read-only on a full disk) when to try again

    def __repr__(self) -> str:
        return f"DiskBackend({str(self._directory)!r}, max_bytes={self._max_bytes})"

    @property
    def directory(self) -> Path:
        """The directory holding the database file."""
        return self._directory

    @property
    def max_bytes(self) -> int:
        """The bound on stored keys + values."""
        return self._max_bytes

    @property
    def touches_dropped(self) -> int:
        """Recencies of reads not written (a full disk, say): LRU is the poorer for them."""
        return self._recencies.dropped

    @property
    def read_only(self) -> bool:
        """Opened on a read-only directory or file system: it serves what it holds."""
        return self._refusing is StoreReadOnly

    async def get(self, key: str) -> bytes | None:
        """The value (its recency refreshed in a later batch); an expired row misses."""
        now = self._clock()
        value = await self._run(lambda conn: self._get(conn, key, now))
        if self._recencies.due(now) and not self._closed:
            # Not awaited: the next job on the worker thread (a hand-off, not a write).
            with contextlib.suppress(RuntimeError):  # (the store closing meanwhile)
                asyncio.get_running_loop().run_in_executor(self._executor,
                                                           self._recencies.hand_off)
        return value

    async def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        """Store value and evict least recently used rows; returns after the commit."""
        now = self._clock()
        expires_at = expiry(now, ttl)
        await self._run(lambda conn: self._set(conn, key, value, expires_at, now))

    async def delete(self, key: str) -> bool:
        """Remove key; True only when the row was present and not expired."""
        now = self._clock()
        return await self._run(lambda conn: self._delete(conn, key, now))

    async def purge_namespace(self, namespace: str, *, pause: PurgePause | None = None
                              ) -> int:
        """Delete every key starting with namespace + "/", in batches; return the count.
        The batches run in a child process (backends/disk_purger.py), on a connection of
        its own: reads never wait for it (WAL readers do not wait for the writer), nor share
        the interpreter with it, and the serving connection takes the new byte total from
        the database (O(1)) when it sees the commits."""
        if self._closed:
            raise BackendError(f"{self!r} is closed")
        database = self._directory / DB_FILENAME
        if not database.exists():
            return 0  # (nothing was ever stored here)
        await self._run(lambda conn: None)  # (opened: how it was opened is known)
        if self._refusing is StoreReadOnly:
            raise StoreReadOnly(f"disk store {str(self._directory)!r} is read-only: "
                                "nothing can be purged")
        try:
            purger = await Purger.start(database, namespace, batch=PURGE_BATCH,
                                        busy_timeout_s=_BUSY_TIMEOUT_S, cache_kib=PAGE_CACHE_KIB)
        except OSError as exc:
            raise BackendError(f"{self!r}: cannot start a purge process: {exc}") from exc
        self._purgers.add(purger)
        total = 0
        try:
            while True:
                if total and pause is not None:  # (between two steps)
                    await pause()
                if self._closed:
                    raise BackendError(f"{self!r} is closed")
                removed = await self._purge_step(purger)
                if removed:
                    self._writable_retry_at = 0.0  # (read-only on a full disk: reopen, see)
                total += removed
                if removed < PURGE_BATCH:
                    return total
        finally:
            self._purgers.discard(purger)
            await purger.aclose()

    async def scan(self, prefix: str, *, after: str = "", limit: int = 1000) -> list[str]:
        """Keys starting with prefix and greater than after, sorted, at most limit."""
        return await self._run(lambda conn: _scan(conn, prefix, after, limit))

    async def namespace_stats(self, namespace: str) -> tuple[int, int]:
        """(entries, bytes) of one namespace."""
        bounds = _bounds(namespace + "/")
        row = await self._run(lambda conn: conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries WHERE key >= ? AND key < ?",
            bounds).fetchone())
        return int(row[0]), int(row[1])

    async def stats(self) -> StoreStatsResult:
        """Rows and bytes held, including expired rows not yet read."""
        return await self._run(self._stats)

    async def aclose(self) -> None:
        """Close the connection on its thread (the recencies written first), stop the
        worker and end the purges under way; idempotent."""
        if self._close_done is None:
            self._closed = True
            self._close_done = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_done)  # (a cancelled caller leaves it to finish)

    async def _close(self) -> None:
        closed = asyncio.get_running_loop().run_in_executor(self._executor, self._close_conn)
        self._executor.shutdown(wait=False)
        # (each purge raises at its next step; one still starting ends itself so)
        await asyncio.gather(*(purger.aclose() for purger in list(self._purgers)))
        await closed
        await self._recencies.aclose()

    # -- event-loop side ------------------------------------------------------------

    async def _purge_step(self, purger: Purger) -> int:
        """One batch of a purge, by its child process."""
        try:
            return await purger.step()
        except (sqlite3.Error, OSError) as exc:
            raise store_error(self._directory, exc) from exc

    async def _run(self, op: Callable[[sqlite3.Connection], _T]) -> _T:
        if self._closed:
            raise BackendError(f"{self!r} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, op)

    # -- worker thread --------------------------------------------------------------

    def _call(self, op: Callable[[sqlite3.Connection], _T]) -> _T:
        self._look()
        try:
            try:
                return op(self._connection())
            except sqlite3.DatabaseError as exc:
                if not corrupt(exc):
                    raise
                if self._conn is not None and self._refusing is not None:
                    # Read through a read-only (immutable) connection, which may have read a
                    # file another process changed under it: not moved aside (nor could it be,
                    # read-only). The next call opens it anew, writable first.
                    self._close_conn(flush=False)
                    raise
                self._quarantine(exc)  # then once more, on a fresh file
                return op(self._connection())
        except (sqlite3.Error, OSError) as exc:
            raise store_error(self._directory, exc) from exc

    def _look(self) -> None:
        """Raise a store error, without calling SQLite, while a file of the store is frozen
        or truncated (backends/disk_frozen.py: touching its mapping would kill the process);
        say so when that starts and when it ends."""
        if self._conn is None:
            self._watch.reset()  # (no connection holds them: the files may be new ones)
        broken, was = self._watch.broken(), self._broken
        self._broken = broken
        self._recencies.paused = bool(broken)
        path = str(self._directory / DB_FILENAME)
        if broken and not was:
            log.warning("disk_store_frozen", path=path, reason=broken,
                        note="the store is neither read nor written until its files may be "
                             "written again: answers come from the model, not stored")
        elif was and not broken:
            log.info("disk_store_thawed", path=path, note="its files may be written again")
        if broken:
            raise BackendError(f"disk store {str(self._directory)!r}: {broken}")

    def _quarantine(self, exc: sqlite3.DatabaseError) -> None:
        """Move a corrupt database file aside (disk_open.quarantine), so that the next
        connection starts a fresh one; say so loudly."""
        self._close_conn(flush=False)
        self._recencies.forget()  # (before the file moves: no recency write under way)
        aside = quarantine(self._directory)  # (a purge's child fails, or ends on the old file)
        self._bytes, self._data_version = 0, None
        self.quarantined.append(aside)
        log.warning("disk_store_quarantined", error=str(exc), moved_to=str(aside),
                    note="a fresh database was started; the entries in the old one are lost")

    def _connection(self) -> sqlite3.Connection:
        # A failed open is retried on the next call, so a transient fault heals itself.
        if self._conn is None:
            opened = open_database(self._directory)
            self._conn, self._data_version = opened.conn, None
            self._opened(opened.refusing)
        elif self._refusing is StoreFull and self._clock() >= self._writable_retry_at:
            # Opened read-only (immutable: it sees no other connection's commits, a purge's
            # included) on a full disk: reads try to heal it too, not only writes.
            with contextlib.suppress(StoreFull):
                return self._writable(self._conn)
        # data_version moves only on other connections' commits (say `cacheproxy purge`);
        # read the total again then, so the running total never drifts from the table.
        (version,) = self._conn.execute("PRAGMA data_version").fetchone()
        if version != self._data_version:
            self._bytes, self._data_version = _total(self._conn), int(version)
        return self._conn

    def _opened(self, refusing: type[StoreRefused] | None) -> None:
        """Note how the database was opened (disk_open.open_database); say so on a change."""
        path = str(self._directory / DB_FILENAME)
        if refusing is StoreFull:
            self._writable_retry_at = self._clock() + WRITABLE_RETRY
        if refusing is StoreReadOnly and self._refusing is not StoreReadOnly:
            log.warning("disk_store_read_only", path=path,
                        note="stored entries are served; new ones are not stored")
        elif refusing is StoreFull and self._refusing is not StoreFull:
            log.warning("disk_store_full", path=path,
                        note="too full to open writable: stored entries are served read-only, "
                             f"new ones not stored; a write tries again every {WRITABLE_RETRY:g} s")
        elif refusing is None and self._refusing is StoreFull:
            log.info("disk_store_writable", path=path, note="room again: new entries are stored")
        self._refusing = refusing

    def _writable(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        """The connection a write goes to: conn when it is writable; when the store was
        opened read-only on a full disk, one opened writable anew once its time has come
        (the store heals); else the refusal."""
        refusing = self._refusing
        if refusing is None:
            return conn
        where = f"disk store {str(self._directory)!r}"
        if refusing is StoreReadOnly:
            raise StoreReadOnly(f"{where} is read-only: nothing new is stored")
        if self._clock() < self._writable_retry_at:
            raise StoreFull(f"{where}: the disk was too full to open it writable")
        try:
            writable = open_writable(self._directory)
        except sqlite3.OperationalError as exc:
            self._writable_retry_at = self._clock() + WRITABLE_RETRY
            if not too_full(exc):
                raise
            raise StoreFull(f"{where}: the disk is still too full to open it writable ({exc})"
                            ) from exc
        self._close_conn(flush=False)
        self._conn, self._data_version = writable, None
        self._opened(None)
        return self._connection()

    def _close_conn(self, *, flush: bool = True) -> None:
        broken = self._watch.broken() if self._conn is not None else ""
        if flush:
            self._recencies.settle(None if broken else self._conn)
        if self._conn is not None:
            conn, self._conn = self._conn, None
            if broken:  # (closing it would checkpoint through the frozen mapping)
                abandon(conn)
                log.warning("disk_store_connection_abandoned", reason=broken,
                            path=str(self._directory / DB_FILENAME))
            else:
                conn.close()
        self._watch.reset()

    def _get(self, conn: sqlite3.Connection, key: str, now: float) -> bytes | None:
        row = conn.execute(
            "SELECT value, size, expires_at, accessed_at FROM entries WHERE key = ?", (key,)
        ).fetchone()
        if row is None:
            return None
        value: bytes
        value, size, expires_at, accessed_at = row
        if is_expired(expires_at, now):
            try:
                deleted = conn.execute(
                    "DELETE FROM entries WHERE key = ? AND expires_at <= ?", (key, now)
                ).rowcount
            except sqlite3.Error:  # a full disk: the row stays, expired, and still misses
                return None
            if deleted:
                self._bytes -= size
            return None
        if now - accessed_at >= TOUCH_EVERY and self._refusing is None:
            # Recency to the second is enough for LRU, and saves a write on most hits.
            self._recencies.record(key, now)
        return value

    def _set(self, conn: sqlite3.Connection, key: str, value: bytes,
             expires_at: float | None, now: float) -> None:
        conn = self._writable(conn)
        read = self._recencies.settled()  # eviction below sees the reads' recency
        try:
            self._insert(conn, key, value, expires_at, now, read)
        except BaseException:
            self._recencies.drop(len(read))
            raise

    def _insert(self, conn: sqlite3.Connection, key: str, value: bytes,
                expires_at: float | None, now: float, read: dict[str, float]) -> None:
        """Store the entry and the recencies read (one transaction: the write lock once),
        evicting from the byte total as it is then: another process's purge may have
        committed while this waited for the lock."""
        size = entry_size(key, value)
        with _transaction(conn):
            if read:
                _write_recencies(conn, read)
            total = _total(conn)
            old = conn.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
            if old is not None:
                # The old value is stale even if the new one is too big to keep.
                conn.execute("DELETE FROM entries WHERE key = ?", (key,))
                total -= old[0]
            if size <= self._max_bytes:
                conn.execute(
                    "INSERT INTO entries (key, size, expires_at, accessed_at, value)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (key, size, expires_at, now, value),
                )
                total = _evict(conn, total + size, self._max_bytes, keep=key)
        self._bytes = total  # only after the commit, so a rollback leaves it right

    def _delete(self, conn: sqlite3.Connection, key: str, now: float) -> bool:
        conn = self._writable(conn)
        with _transaction(conn):
            row = conn.execute(
                "SELECT size, expires_at FROM entries WHERE key = ?", (key,)
            ).fetchone()
            if row is None:
                return False
            conn.execute("DELETE FROM entries WHERE key = ?", (key,))
        self._bytes -= row[0]
        return not is_expired(row[1], now)

    def _stats(self, conn: sqlite3.Connection) -> StoreStatsResult:
        (count,) = conn.execute("SELECT COUNT(*) FROM entries").fetchone()
        return StoreStatsResult(int(count), self._bytes, self._max_bytes)


def _scan(conn: sqlite3.Connection, prefix: str, after: str, limit: int) -> list[str]:
    low, high = _bounds(prefix) if prefix else ("", "\U0010ffff")
    # One lower bound: given `key >= low AND key > after`, SQLite seeks to low and reads
    # every key up to after (listing 1M entries page by page took 33 s, O(n^2)).
    start, above = (after, ">") if after >= low else (low, ">=")
    rows = conn.execute(
        f"SELECT key FROM entries WHERE key {above} ? AND key < ? ORDER BY key LIMIT ?",
        (start, high, limit),
    ).fetchall()
    return [k for (k,) in rows]


def _total(conn: sqlite3.Connection) -> int:
    """The byte total of the entries (summed only in a database without the totals table:
    one written by an earlier version, opened read-only)."""
    try:
        row = conn.execute("SELECT bytes FROM totals WHERE id = 0").fetchone()
    except sqlite3.OperationalError:
        row = None
    if row is None:
        row = conn.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
    return int(row[0])


def _evict(conn: sqlite3.Connection, total: int, max_bytes: int, *, keep: str) -> int:
    """Delete least recently accessed rows (never keep) until total <= max_bytes."""
    while total > max_bytes:
        victims = conn.execute(
            "SELECT key, size FROM entries WHERE key != ? ORDER BY accessed_at, rowid LIMIT ?",
            (keep, _EVICT_BATCH),
        ).fetchall()
        if not victims:
            break
        for victim, size in victims:
            conn.execute("DELETE FROM entries WHERE key = ?", (victim,))
            total -= size
            if total <= max_bytes:
                break
    return total
