"""The disk store's namespace purges, run in a process of their own.

A purge of a million entries deletes for a minute or more. On a thread of the serving
process its batches shared the interpreter with the event loop and the store's thread: the
hit p99 of other namespaces rose 2.6-3.7x while it ran, where the same purge from another
process (`cacheproxy purge`) cost 1.2-1.3x (#18 cost curves). So `DiskBackend.purge_namespace`
starts this file as a child (`python -I -S`, stdlib only: ~20 ms to start) and drives it a
batch at a time over its stdin and stdout: a line in, one batch deleted and committed, a line
out (`removed N`, or `error CODE MESSAGE` for SQLite's error and extended code). Its end of
stdin ends it. The serving connection sees the commits (PRAGMA data_version) as it sees
those of any other process.

Being stdlib only, it also holds what every connection of the store shares with the child:
the key range of a prefix, the write transaction, the tuning of a writable connection
(backends/disk_open.py and disk.py take them from here).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

STOP_WAIT_S = 5.0  # a child asked to end (stdin closed) gets this long, then is killed


def bounds(prefix: str) -> tuple[str, str]:
    """[prefix, successor) as a key range: every key that starts with prefix."""
    return prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any failure (including the commit)."""
    # IMMEDIATE takes the write lock up front, so a read-then-write cannot hit SQLITE_BUSY midway.
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        # Some errors (disk full, I/O) already rolled back; a second ROLLBACK would mask them.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def tune(conn: sqlite3.Connection, cache_kib: int) -> None:
    """The settings of a writable connection (they are the connection's, not the file's)."""
    # NORMAL in WAL: a power cut may lose the last commits but never corrupts.
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA journal_size_limit=67108864")
    conn.execute(f"PRAGMA cache_size=-{cache_kib}")


def purge_batch(conn: sqlite3.Connection, namespace: str, batch: int) -> int:
    """Delete up to `batch` keys of namespace in one transaction; how many."""
    # A key range instead of LIKE: it uses the primary key and needs no escaping.
    low, high = bounds(namespace + "/")
    with transaction(conn):
        rows = conn.execute(
            "SELECT key FROM entries WHERE key >= ? AND key < ? LIMIT ?", (low, high, batch),
        ).fetchall()
        conn.executemany("DELETE FROM entries WHERE key = ?", rows)
    return len(rows)


class Purger:
    """The parent's end of one purge child (one purge: started, stepped, closed)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process

    @classmethod
    async def start(cls, database: Path, namespace: str, *, batch: int, busy_timeout_s: float,
                    cache_kib: int) -> Purger:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", __file__, str(database), namespace, str(batch),
            str(busy_timeout_s), str(cache_kib),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        return cls(process)

    @property
    def pid(self) -> int:
        return self._process.pid

    async def step(self) -> int:
        """One batch deleted and committed by the child: how many keys. A failure of SQLite
        is raised as the sqlite3 error it was (with its codes), the child's death as
        OSError."""
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(b"\n")
            await process.stdin.drain()
            line = await process.stdout.readline()
        except (ConnectionError, BrokenPipeError) as exc:
            raise OSError(f"the purge process ended: {await self._stderr()}") from exc
        word, _, rest = line.decode().rstrip("\n").partition(" ")
        if word == "removed":
            return int(rest)
        if word == "error":
            code, _, message = rest.partition(" ")
            error = sqlite3.OperationalError(message)
            error.sqlite_errorcode = int(code)
            raise error
        raise OSError(f"the purge process ended: {await self._stderr()}")

    async def aclose(self) -> None:
        """End the child (after its batch in hand; killed if it takes over STOP_WAIT_S)."""
        process = self._process
        if process.returncode is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), STOP_WAIT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        else:
            await process.wait()

    async def _stderr(self) -> str:
        process = self._process
        await process.wait()
        assert process.stderr is not None
        text = (await process.stderr.read()).decode(errors="replace").strip()
        return f"exit code {process.returncode}" + (f": {text[-500:]}" if text else "")


def main(argv: list[str]) -> int:
    """The child: argv = database, namespace, batch, busy timeout (s), page cache (KiB)."""
    database, namespace, batch, busy_timeout_s, cache_kib = argv
    conn: sqlite3.Connection | None = None
    try:
        for _ in sys.stdin:
            try:
                if conn is None:  # (opened on the first step: a failure to open is its reply)
                    conn = _open(database, float(busy_timeout_s), int(cache_kib))
                reply = f"removed {purge_batch(conn, namespace, int(batch))}"
            except sqlite3.Error as exc:
                code = getattr(exc, "sqlite_errorcode", None) or sqlite3.SQLITE_ERROR
                reply = f"error {code} {' '.join(str(exc).split())}"
            print(reply, flush=True)
            if reply.startswith("error"):
                return 1
    finally:
        if conn is not None:
            conn.close()
    return 0


def _open(database: str, busy_timeout_s: float, cache_kib: int) -> sqlite3.Connection:
    # mode=rw: never creates a database; WAL mode is the file's own, kept by it.
    conn = sqlite3.connect(f"file:{quote(database)}?mode=rw", uri=True,
                           timeout=busy_timeout_s, isolation_level=None)
    try:
        tune(conn, cache_kib)
    except BaseException:
        conn.close()
        raise
    return conn

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
