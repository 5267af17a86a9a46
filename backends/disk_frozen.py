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

Only the mapped file can kill the process: it is looked at before every call, an ioctl
(FS_IOC_GETFLAGS) and an fstat on a descriptor held open (~3 µs each on a VM, 2-5 % of a
disk GET). The database and its WAL, whose writes go through write(2) and fail as errors
(EPERM: a store error, or a checkpoint that waits), at most once every LOOK_EVERY seconds:
so that a store frozen there is said to be, and stores nothing, rather than erring half-way.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import sqlite3
import struct
import time
from pathlib import Path

FS_IOC_GETFLAGS = 0x80086601  # _IOR('f', 1, long), as lsattr asks
FS_IMMUTABLE_FL = 0x10
FS_APPEND_FL = 0x20
SUFFIXES = ("", "-wal", "-shm")  # the mapped one last
LOOK_EVERY = 1.0  # seconds between looks at the files that are not mapped


def frozen(fd: int) -> bool:
    """Whether the file open as fd is immutable or append-only (False where the file
    system has no such flags)."""
    try:
        raw = fcntl.ioctl(fd, FS_IOC_GETFLAGS, b"\0" * 8)
    except OSError:
        return False
    (flags,) = struct.unpack("i", raw[:4])
    return bool(flags & (FS_IMMUTABLE_FL | FS_APPEND_FL))


def frozen_file(database: Path) -> Path | None:
    """The first of the database's files (itself, its WAL, its shared memory) that is frozen,
    opened anew for the look (for a thread that holds no descriptors)."""
    for path in files(database):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if frozen(fd):
                return path
        finally:
            os.close(fd)
    return None


def files(database: Path) -> list[Path]:
    """The database file, its WAL and its shared-memory file."""
    return [database.with_name(database.name + suffix) for suffix in SUFFIXES]


class Watch:
    """Descriptors held on the files of one open connection (the store's thread only):
    opened after the connection is, closed with it (`reset`)."""

    def __init__(self, database: Path) -> None:
        self._paths = files(database)
        self._fds: dict[Path, int] = {}
        self._shm_size = 0  # the largest size seen: SQLite grows the file, never shrinks it
        self._unmapped = ""  # what the last look at the others found
        self._looked_at = -LOOK_EVERY  # (time.monotonic) when

    def broken(self) -> str:
        """Why the connection's files may not be touched now ("" when they may)."""
        *unmapped, mapped = self._paths
        shm = self._fd(mapped)
        if shm is not None:
            if frozen(shm):
                return f"{mapped.name} is immutable or append-only (chattr)"
            size = os.fstat(shm).st_size
            if size < self._shm_size:
                return (f"{mapped.name} was truncated under its mapping "
                        f"({self._shm_size} -> {size} bytes)")
            self._shm_size = size
        now = time.monotonic()
        if self._unmapped or now - self._looked_at >= LOOK_EVERY:
            self._looked_at = now
            self._unmapped = next((f"{path.name} is immutable or append-only (chattr)"
                                   for path in unmapped
                                   if (fd := self._fd(path)) is not None and frozen(fd)), "")
        return self._unmapped

    def reset(self) -> None:
        """Forget the descriptors (the connection closed, or the files moved aside)."""
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._shm_size = 0
        self._unmapped, self._looked_at = "", -LOOK_EVERY

    def _fd(self, path: Path) -> int | None:
        fd = self._fds.get(path)
        if fd is None:
            with contextlib.suppress(OSError):  # (not there yet: looked for again next time)
                fd = self._fds[path] = os.open(
                    path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        return fd


def abandon(conn: sqlite3.Connection) -> None:
    """Never close conn: closing the last connection checkpoints, which writes the frozen
    mapping (SIGBUS). Its reference is leaked so that no collection closes it either (nor
    the interpreter's teardown); the process's exit unmaps it."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(conn))
