"""The disk store's files that may no longer be written under it: immutable or append-only
(`chattr +i`, `+a`), or its shared-memory file truncated (#34).

SQLite maps the WAL index (the `-shm` file) into the process and writes it in place, on
reads too (a read marks the WAL frame it reads up to). Setting the immutable flag, ext4
writes the file's dirty pages and maps them read-only; the next write to such a page, and
any touch of a page past a truncated file's end, is a SIGBUS, which kills the process (no
handler can resume the faulting write). So the store looks before every call into SQLite
(`Watch.broken`): with a file frozen or truncated, SQLite is not called, and the call fails
as a store error (the service answers from the model, not stored) until the flag is lifted.
A flag set in the microseconds between the look and the write is not caught.

Only the mapped file can kill the process: it is looked at before every call, one statx(2)
by path (~2 µs). The database and its WAL, whose writes go through write(2) and fail as
errors (EPERM: a store error, or a checkpoint that waits), at most once every LOOK_EVERY
seconds: so that a store frozen there is said to be, and stores nothing, rather than erring
half-way.

The looks go by path and never open a descriptor on SQLite's files: SQLite's locks are POSIX
record locks, which a process loses on a file when it closes *any* descriptor of that file,
so a look that opened and closed one would drop the locks every connection of this process
holds (another connection's writes then fail with "disk I/O error", or worse, overlap).
"""

from __future__ import annotations

import ctypes
import os
import sqlite3
import time
from pathlib import Path

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
STATX_SIZE = 0x200
STATX_ATTR_IMMUTABLE = 0x10
STATX_ATTR_APPEND = 0x20
SUFFIXES = ("", "-wal", "-shm")  # the mapped one last
LOOK_EVERY = 1.0  # seconds between looks at the files that are not mapped

_libc = ctypes.CDLL(None, use_errno=True)
_statx = getattr(_libc, "statx", None)  # glibc 2.28+; without it, flags are not looked at
_BUFFER = 256  # sizeof(struct statx)
_ATTRIBUTES, _SIZE = 0x08, 0x28  # offsets of stx_attributes and stx_size


def look(path: Path) -> tuple[bool, int] | None:
    """(frozen: immutable or append-only, size) of the file at path, None when it is not
    there (or cannot be looked at); frozen is False where the system cannot tell."""
    if _statx is None:
        try:
            return False, os.stat(path, follow_symlinks=False).st_size
        except OSError:
            return None
    buffer = ctypes.create_string_buffer(_BUFFER)
    if _statx(AT_FDCWD, os.fsencode(path), AT_SYMLINK_NOFOLLOW, STATX_SIZE, buffer) != 0:
        return None
    attributes = int.from_bytes(buffer.raw[_ATTRIBUTES:_ATTRIBUTES + 8], "little")
    size = int.from_bytes(buffer.raw[_SIZE:_SIZE + 8], "little")
    return bool(attributes & (STATX_ATTR_IMMUTABLE | STATX_ATTR_APPEND)), size


def frozen_file(database: Path) -> Path | None:
    """The first of the database's files (itself, its WAL, its shared memory) that is
    frozen."""
    for path in files(database):
        seen = look(path)
        if seen is not None and seen[0]:
            return path
    return None


def files(database: Path) -> list[Path]:
    """The database file, its WAL and its shared-memory file."""
    return [database.with_name(database.name + suffix) for suffix in SUFFIXES]


class Watch:
    """The looks at the files of one open connection (the store's thread only); `reset`
    when the connection closes."""

    def __init__(self, database: Path) -> None:
        self._paths = files(database)
        self._shm_size = 0  # the largest size seen: SQLite grows the file, never shrinks it
        self._unmapped = ""  # what the last look at the others found
        self._looked_at = -LOOK_EVERY  # (time.monotonic) when

    def broken(self) -> str:
        """Why the connection's files may not be touched now ("" when they may)."""
        *unmapped, mapped = self._paths
        seen = look(mapped)
        if seen is not None:
            frozen, size = seen
            if frozen:
                return f"{mapped.name} is immutable or append-only (chattr)"
            if size < self._shm_size:
                return (f"{mapped.name} was truncated under its mapping "
                        f"({self._shm_size} -> {size} bytes)")
            self._shm_size = size
        now = time.monotonic()
        if self._unmapped or now - self._looked_at >= LOOK_EVERY:
            self._looked_at = now
            self._unmapped = next((f"{path.name} is immutable or append-only (chattr)"
                                   for path in unmapped
                                   if (seen := look(path)) is not None and seen[0]), "")
        return self._unmapped

    def reset(self) -> None:
        """Forget what was seen (the connection closed, or the files moved aside)."""
        self._shm_size = 0
        self._unmapped, self._looked_at = "", -LOOK_EVERY


def abandon(conn: sqlite3.Connection) -> None:
    """Never close conn: closing the last connection checkpoints, which writes the frozen
    mapping (SIGBUS). Its reference is leaked so that no collection closes it either (nor
    the interpreter's teardown); the process's exit unmaps it."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(conn))
