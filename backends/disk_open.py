"""Opening the disk store's SQLite file, and what its failures mean to the service.

The database is opened writable when it can be. When the disk will not let it be written,
a database that exists is opened read-only, so that what it holds is still served:
`immutable=1`, which takes no locks and needs no shared-memory file (a WAL database opened
without it needs one, and writable). That is done on a read-only directory or file system,
and on a disk too full to open it writable (no room to size the shared-memory file,
SQLITE_IOERR_SHMSIZE, or SQLITE_FULL) when the file holds every commit: its WAL holds no
frames (the file without them may be an older state, or half of a checkpoint).
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from backends.base import BackendError, StoreFull, StoreReadOnly, StoreRefused

# Stdlib only there, so that the purge's child process runs them without this package:
from backends.disk_purger import transaction as transaction
from backends.disk_purger import tune

DB_FILENAME = "cache.sqlite3"
BUSY_TIMEOUT_S = 5.0
_WAL_HEADER_BYTES = 32  # a WAL file no longer than its header holds no frames
# Only these say the database may not be written. The other SQLITE_READONLY_* codes
# (CANTLOCK, RECOVERY, CANTINIT, DBMOVED, ROLLBACK) are a lock, a recovery or a set-up that
# failed, or a file moved away: faults, which open the breaker.
_READ_ONLY_CODES = frozenset({sqlite3.SQLITE_READONLY, sqlite3.SQLITE_READONLY_DIRECTORY})

# The BLOB goes last so reading size/expires_at never walks a value's overflow pages.
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS entries (
        key TEXT PRIMARY KEY,
        size INTEGER NOT NULL,
        expires_at REAL,
        accessed_at REAL NOT NULL,
        value BLOB NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS entries_by_access ON entries (accessed_at)",
)
# The byte total kept by the database itself, for every connection (another process's
# too): reading it is O(1), where summing the table after another connection's commit cost
# ~400 ms at a million entries, on the next read.
_TOTALS = (
    "CREATE TABLE IF NOT EXISTS totals (id INTEGER PRIMARY KEY CHECK (id = 0),"
    " bytes INTEGER NOT NULL)",
    "CREATE TRIGGER IF NOT EXISTS entries_added AFTER INSERT ON entries"
    " BEGIN UPDATE totals SET bytes = bytes + NEW.size WHERE id = 0; END",
    "CREATE TRIGGER IF NOT EXISTS entries_removed AFTER DELETE ON entries"
    " BEGIN UPDATE totals SET bytes = bytes - OLD.size WHERE id = 0; END",
    "CREATE TRIGGER IF NOT EXISTS entries_resized AFTER UPDATE OF size ON entries"
    " BEGIN UPDATE totals SET bytes = bytes - OLD.size + NEW.size WHERE id = 0; END",
)


@dataclass(frozen=True, slots=True)
class Opened:
    """A connection to the database and, when it was opened read-only, what a write is."""

    conn: sqlite3.Connection
    refusing: type[StoreRefused] | None = None  # None: writable


def open_database(directory: Path) -> Opened:
    """The database in `directory`: writable, else read-only as the module says, else the
    writable open's error."""
    try:
        return Opened(open_writable(directory))
    except sqlite3.OperationalError as exc:
        refusing = _read_only_because(directory, exc)
        if refusing is None:
            raise
    database = directory / DB_FILENAME
    conn = sqlite3.connect(f"file:{quote(str(database))}?immutable=1", uri=True,
                           timeout=BUSY_TIMEOUT_S, isolation_level=None)
    conn.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
    return Opened(conn, refusing)


# SQLite's page cache per connection (KiB; its default is 2 MiB): random reads over a store
# of a million entries (a 2 GB file) missed it at every B-tree level; measured on a 1M
# store, GET p99 94 µs with the default, 19 µs with 64 MiB. It fills only as pages are read.
PAGE_CACHE_KIB = 64 << 10


def open_writable(directory: Path) -> sqlite3.Connection:
    """The database in `directory` (created with it when missing), in WAL mode."""
    directory.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(directory / DB_FILENAME, timeout=BUSY_TIMEOUT_S,
                           isolation_level=None)
    try:
        (mode,) = conn.execute("PRAGMA journal_mode=WAL").fetchone()
        if mode != "wal":
            raise sqlite3.OperationalError(f"cannot enable WAL (journal_mode={mode})")
        tune(conn, PAGE_CACHE_KIB)
        for statement in _SCHEMA:
            conn.execute(statement)
        with transaction(conn):  # (with the triggers, so no row is counted twice or not)
            for statement in _TOTALS:
                conn.execute(statement)
            if conn.execute("SELECT 1 FROM totals").fetchone() is None:  # once per file
                conn.execute("INSERT INTO totals (id, bytes)"
                             " SELECT 0, COALESCE(SUM(size), 0) FROM entries")
    except BaseException:
        conn.close()
        raise
    return conn


def _read_only_because(directory: Path, exc: sqlite3.OperationalError
                       ) -> type[StoreRefused] | None:
    """Why the database that could not be opened writable is to be opened read-only; None
    when it is not (nothing to serve, or a fault)."""
    database = directory / DB_FILENAME
    if not database.exists():
        return None
    if not os.access(directory, os.W_OK) or _read_only_mount(directory):
        return StoreReadOnly
    return StoreFull if too_full(exc) and not _wal_has_frames(database) else None


def too_full(exc: sqlite3.OperationalError) -> bool:
    """Whether opening the database writable failed for want of room: to size its
    shared-memory file (SQLITE_IOERR_SHMSIZE) or to write (SQLITE_FULL)."""
    code = getattr(exc, "sqlite_errorcode", 0)  # (absent on errors raised in Python)
    return code == sqlite3.SQLITE_IOERR_SHMSIZE or code & 0xFF == sqlite3.SQLITE_FULL


def _read_only_mount(directory: Path) -> bool:
    """Whether `directory` is on a file system mounted read-only (root writes anywhere else)."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _wal_has_frames(database: Path) -> bool:
    try:
        size = database.with_name(database.name + "-wal").stat().st_size
    except FileNotFoundError:
        return False
    return size > _WAL_HEADER_BYTES


def store_error(directory: Path, exc: sqlite3.Error | OSError) -> BackendError:
    """What a failed database call is to the service: StoreFull (the disk is full),
    StoreReadOnly (the database may not be written), else a BackendError (a fault)."""
    refused = refusal(exc) if isinstance(exc, sqlite3.Error) else None
    return (refused or BackendError)(f"disk store {str(directory)!r}: {exc}")


def refusal(exc: sqlite3.Error) -> type[StoreRefused] | None:
    """The refusal an error of SQLite is, by its (extended) result code; None for a fault."""
    code = getattr(exc, "sqlite_errorcode", None)  # (absent on errors raised in Python)
    if code is None:
        return None
    if code & 0xFF == sqlite3.SQLITE_FULL:  # (SQLITE_FULL has no extended codes)
        return StoreFull
    return StoreReadOnly if code in _READ_ONLY_CODES else None


def corrupt(exc: sqlite3.DatabaseError) -> bool:
    """SQLite's words for a file that is not (or no longer) a database."""
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


def quarantine(directory: Path) -> Path:
    """Move the database file (and its WAL and shared memory) aside, named with the time, so
    that the next open starts a fresh one; where the file went."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    database = directory / DB_FILENAME
    aside = database.with_name(f"{DB_FILENAME}.corrupt-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        source = database.with_name(DB_FILENAME + suffix)
        if source.exists():
            source.rename(aside.with_name(aside.name + suffix))
    return aside
