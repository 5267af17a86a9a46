"""The disk store's recencies: when each entry was last read, for its LRU eviction.

A read never writes: it records the time on the store's thread (`record`), and the
recencies are written in batches, on a thread and a connection of their own (`hand_off`),
one batch at a time, then a PASSIVE checkpoint of the WAL there too (a store that is only
read still checkpoints). Written on the store's one thread, ahead of the next reads, they
held every GET behind them: 35-60 ms for 256 recencies at a million entries (4 ms at 10k:
random pages of the table and of its index by access time), up to 1.3 s while a purge held
the write lock (#18 cost curves). Before an eviction the store waits for the batch in flight
and writes the rest in the write's own transaction (`settled`, `write`); at close it does the
same in one of its own (`settle`): eviction sees every read recorded before it. Recency is a
hint: on a full disk, or past the bound on those waiting, they are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

from backends.disk_frozen import frozen_file
from backends.disk_open import BUSY_TIMEOUT_S, transaction

BATCH = 256  # recencies that make a write
WRITE_EVERY = 2.0  # seconds of the store's clock: or a write this often, however few
PENDING_LIMIT = 16 * BATCH  # recorded while a write waits (a lock): more are dropped


class Recencies:
    """Read times recorded on the store's thread, written in batches off it."""

    def __init__(self, database: Path) -> None:
        self._uri = f"file:{quote(str(database))}?mode=rw"  # (never creates the file)
        self._database = database
        # Set by the store while its files may not be touched (disk_frozen: a truncated
        # shared-memory file is not a flag a look here would see).
        self.paused = False
        self._pending: dict[str, float] = {}  # key -> read time; only the store's thread
        self._writing: Future[None] | None = None  # the batch in flight
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheproxy-recency")
        self._written_at = 0.0
        self._dropped_lock = threading.Lock()
        self._dropped = 0

    @property
    def dropped(self) -> int:
        """Recencies not written (a full or read-only disk, a database locked past the busy
        timeout, too many waiting)."""
        return self._dropped

    def record(self, key: str, now: float) -> None:
        """(the store's thread) A read of key at now."""
        if len(self._pending) >= PENDING_LIMIT and key not in self._pending:
            self.drop(1)
        else:
            self._pending[key] = now

    def due(self, now: float) -> bool:
        """(the event loop) Whether a batch is to be handed off now; marks it handed off."""
        pending = len(self._pending)
        if pending and (pending >= BATCH or now - self._written_at >= WRITE_EVERY):
            self._written_at = now
            return True
        return False

    def hand_off(self) -> None:
        """(the store's thread) The recorded recencies to the recency thread, unless a batch
        is in flight still (then they wait for the next hand-off)."""
        if not self._pending or (self._writing is not None and not self._writing.done()):
            return
        batch, self._pending = self._pending, {}
        try:
            self._writing = self._thread.submit(self._write, batch)
        except RuntimeError:  # (shut down: the store is closing, and settles them)
            self._pending.update(batch)

    def settled(self) -> dict[str, float]:
        """(the store's thread) Wait for the batch in flight; the rest, which the caller
        writes (`write`, in a transaction of its own) or drops (`drop`)."""
        if self._writing is not None:
            self._writing.result()  # (it never raises: a failed write is dropped)
            self._writing = None
        batch, self._pending = self._pending, {}
        return batch

    def settle(self, conn: sqlite3.Connection | None) -> None:
        """(the store's thread) Wait for the batch in flight; write the rest on conn."""
        batch = self.settled()
        if not batch:
            return
        if conn is None:
            self.drop(len(batch))
            return
        try:
            with transaction(conn):
                write(conn, batch)
        except (sqlite3.Error, OSError):
            self.drop(len(batch))

    def forget(self) -> None:
        """(the store's thread) Before the database is moved aside: no write of them may be
        under way then (it could meet the old file and the new one's WAL); the rest dropped."""
        self.drop(len(self.settled()))

    def drop(self, count: int) -> None:
        """Count recencies that will not be written."""
        with self._dropped_lock:
            self._dropped += count

    async def aclose(self) -> None:
        """Stop the recency thread once the batch in flight is written."""
        done = asyncio.get_running_loop().run_in_executor(self._thread, lambda: None)
        self._thread.shutdown(wait=False)
        await done

    def _write(self, batch: dict[str, float]) -> None:
        # A connection for each batch, closed after: one left open would outlive the file
        # if it were quarantined. Not while a file is frozen (disk_frozen: SIGBUS).
        if self.paused or frozen_file(self._database) is not None:
            self.drop(len(batch))
            return
        try:
            with contextlib.closing(sqlite3.connect(self._uri, uri=True, timeout=BUSY_TIMEOUT_S,
                                                    isolation_level=None)) as conn:
                with transaction(conn):
                    write(conn, batch)
                with contextlib.suppress(sqlite3.Error):  # (left to the next one)
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")  # never waits
        except (sqlite3.Error, OSError):
            self.drop(len(batch))


def write(conn: sqlite3.Connection, batch: dict[str, float]) -> None:
    """Write recencies, in the caller's transaction."""
    conn.executemany("UPDATE entries SET accessed_at = ? WHERE key = ? AND accessed_at < ?",
                     [(t, k, t) for k, t in batch.items()])
