"""The disk store on files that may no longer be written under it (#34): `chattr +i` on
the database, its WAL or its shared-memory file while it serves, a restart on frozen files,
a shared-memory file truncated under its mapping. SQLite writes the mapped WAL index in
place: on a frozen page that is a SIGBUS, which kills the process (the controls show it, in a
child process); the store fails its calls instead, says so, and heals when the flag is lifted.

chattr needs root and a file system with inode flags (ext4 here, as /tmp is; .ci/run runs as
root): without them these tests fail, they do not skip. Every flag set is lifted in a
`finally`, so no test leaves an immutable file behind.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from backends import disk_frozen
from backends.base import BackendError
from backends.disk import DB_FILENAME, DiskBackend

SUFFIXES = ["", "-wal", "-shm"]


def _chattr(flag: str, *paths: Path) -> None:
    done = subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"chattr {flag} failed (needs root and ext4-like flags): "
                    f"{done.stderr.strip()}")


@contextmanager
def frozen(*paths: Path) -> Iterator[None]:
    """The files immutable for the block, mutable again after it whatever happens."""
    try:
        _chattr("+i", *paths)
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, paths)], check=False)


def _files(directory: Path, suffixes: list[str] = SUFFIXES) -> list[Path]:
    return [directory / (DB_FILENAME + suffix) for suffix in suffixes]


async def _filled(directory: Path) -> DiskBackend:
    store = DiskBackend(directory)
    for i in range(20):
        await store.set(f"ns/{i}", b"v%d" % i)
    assert all(path.exists() for path in _files(directory))  # (WAL and its index open)
    return store


@pytest.mark.parametrize("suffix", SUFFIXES)
async def test_a_file_frozen_while_serving_fails_calls_until_it_thaws(
        tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_frozen, "LOOK_EVERY", 0.0)  # (the unmapped ones: every call)
    store = await _filled(tmp_path)
    try:
        (path,) = _files(tmp_path, [suffix])
        with capture_logs() as logs, frozen(path):
            for _ in range(3):
                with pytest.raises(BackendError, match="immutable"):
                    await store.get("ns/3")
                with pytest.raises(BackendError, match="immutable"):
                    await store.set("ns/new", b"x")
        assert [e["event"] for e in logs] == ["disk_store_frozen"]  # said once
        assert logs[0]["reason"].startswith(path.name)
        with capture_logs() as logs:
            assert await store.get("ns/3") == b"v3"  # thawed: served again
            await store.set("ns/new", b"x")
            assert await store.get("ns/new") == b"x"
        assert [e["event"] for e in logs] == ["disk_store_thawed"]
    finally:
        await store.aclose()


async def test_a_store_closed_on_frozen_files_leaves_its_entries(tmp_path: Path) -> None:
    """Closing the last connection checkpoints through the mapping: on frozen files the
    connection is left open instead (the process's exit unmaps it)."""
    store = await _filled(tmp_path)
    with capture_logs() as logs, frozen(*_files(tmp_path)):
        await store.aclose()
    assert "disk_store_connection_abandoned" in [e["event"] for e in logs]
    again = DiskBackend(tmp_path)
    try:
        assert [await again.get(f"ns/{i}") for i in range(20)] == \
            [b"v%d" % i for i in range(20)]
    finally:
        await again.aclose()


async def test_a_store_started_on_frozen_files_fails_calls_until_they_thaw(
        tmp_path: Path) -> None:
    store = await _filled(tmp_path)
    other = sqlite3.connect(tmp_path / DB_FILENAME)  # keeps the WAL and its index there
    other.execute("SELECT COUNT(*) FROM entries").fetchone()
    await store.aclose()
    try:
        restarted = DiskBackend(tmp_path)
        try:
            with frozen(*_files(tmp_path)):
                for _ in range(2):
                    with pytest.raises(BackendError, match="immutable"):
                        await restarted.get("ns/3")
                    with pytest.raises(BackendError, match="immutable"):
                        await restarted.set("ns/new", b"x")
            assert await restarted.get("ns/3") == b"v3"
            await restarted.set("ns/new", b"x")
        finally:
            await restarted.aclose()
    finally:
        other.close()


async def test_a_shared_memory_file_truncated_under_the_store_fails_its_calls(
        tmp_path: Path) -> None:
    """The other SIGBUS: a mapped page past the end of its file (truncated by another
    process). What the mapping held is gone: the store fails its calls (the process lives);
    a restart starts the index anew from the WAL."""
    store = await _filled(tmp_path)
    os.truncate(tmp_path / (DB_FILENAME + "-shm"), 0)
    try:
        with capture_logs() as logs, pytest.raises(BackendError, match="truncated"):
            await store.get("ns/3")
        assert [e["event"] for e in logs] == ["disk_store_frozen"]
    finally:
        await store.aclose()


_RAW = textwrap.dedent("""
    import os, sqlite3, subprocess, sys
    directory, fault = sys.argv[1], sys.argv[2]
    db = os.path.join(directory, "raw.sqlite3")
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (v)")
    conn.execute("INSERT INTO t VALUES (1)")
    if fault == "chattr":
        subprocess.run(["chattr", "+i", db + "-shm"], check=True)
    else:
        os.truncate(db + "-shm", 0)
    conn.execute("INSERT INTO t VALUES (2)")
    print(conn.execute("SELECT COUNT(*) FROM t").fetchone()[0], flush=True)
""")


@pytest.mark.parametrize("fault", ["chattr", "truncate"])
def test_control_sqlite_alone_dies_of_sigbus_on_either_fault(tmp_path: Path,
                                                             fault: str) -> None:
    try:
        done = subprocess.run([sys.executable, "-c", _RAW, str(tmp_path), fault],
                              capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "raw.sqlite3-shm")], check=False)
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)


_STORE = textwrap.dedent("""
    import asyncio, subprocess, sys
    from pathlib import Path
    from backends import disk_frozen
    from backends.disk import DiskBackend

    disk_frozen.Watch.broken = lambda self: ""  # the store without its look

    async def main():
        store = DiskBackend(Path(sys.argv[1]))
        for i in range(20):
            await store.set(f"ns/{i}", b"v")
        subprocess.run(["chattr", "+i", sys.argv[1] + "/cache.sqlite3-shm"], check=True)
        await store.set("ns/new", b"v")
        print("survived", flush=True)

    asyncio.run(main())
""")


def test_control_the_store_without_its_look_dies_of_sigbus(tmp_path: Path) -> None:
    try:
        done = subprocess.run([sys.executable, "-c", _STORE, str(tmp_path)],
                              capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / (DB_FILENAME + "-shm"))], check=False)
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)
