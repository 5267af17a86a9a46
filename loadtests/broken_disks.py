"""Broken disks for faults.py: a small tmpfs, filled to the brim or remounted read-only, and a
SQLite database file with pages overwritten under the process that serves it.

Mounting takes root: `tmpfs` raises MountImpossible with mount's own words when it cannot.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

DB_FILENAME = "cache.sqlite3"  # (backends/disk.py's)


class MountImpossible(Exception):
    """A tmpfs could not be mounted (not root, no mount(8), a container without the right)."""


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of `size` mounted on `where` (created) for the block; unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(where)], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise MountImpossible(f"cannot run mount: {exc}") from exc
    if done.returncode != 0:
        raise MountImpossible(f"mount -t tmpfs on {where} failed ({done.stderr.strip()}): "
                              "mounting takes root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def remount(where: Path, mode: str) -> None:
    """Remount `where` read-only ("ro") or writable ("rw"); ro fails while a file is open
    for writing there."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True,
                   capture_output=True, timeout=30)


def free_bytes(where: Path) -> int:
    """Bytes an unprivileged writer may still write on the file system of `where`."""
    stat = os.statvfs(where)
    return stat.f_bavail * stat.f_frsize


def fill(where: Path, leave: int = 0) -> int:
    """Write a junk file on the file system of `where` until at most `leave` bytes are free
    (0: until it is full); the bytes written."""
    written = 0
    with (where / "junk").open("ab", buffering=0) as junk:
        try:
            while free_bytes(where) > leave:
                written += junk.write(b"\0" * min(4096, max(1, free_bytes(where) - leave)))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return written


def checkpoint(database: Path) -> None:
    """Move every page the WAL holds into the database file (from another connection, as
    `cacheproxy` commands would), so damage to the file is damage to every entry."""
    with contextlib.closing(sqlite3.connect(database, isolation_level=None)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def corrupt(database: Path, *, seed: int = 0) -> int:
    """Overwrite the pages after the first two with random bytes (the header stays, so
    SQLite says "malformed", not "not a database"); then another connection commits, so a
    connection serving the file reads it again. The bytes overwritten."""
    damaged = max(0, database.stat().st_size - 8192)
    with database.open("r+b") as f:
        f.seek(8192)
        f.write(random.Random(seed).randbytes(damaged))
    with contextlib.suppress(sqlite3.DatabaseError), \
            contextlib.closing(sqlite3.connect(database, isolation_level=None)) as other:
        other.execute("PRAGMA user_version = 7")
    return damaged


def quarantined(directory: Path) -> list[Path]:
    """The database files the store moved aside as corrupt."""
    return sorted(directory.glob(f"{DB_FILENAME}.corrupt-*[0-9]"))
