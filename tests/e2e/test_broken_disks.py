"""A disk store on a full or read-only disk (#19), through a real proxy on a real port: every
stored entry is still a HIT, a new answer is served and said not stored (`X-Cache: MISS;
reason=store-full` or `store-read-only`), counted in /metrics, and the store is never taken
for down (the breaker stays closed). A 1 MB tmpfs (mounting takes root, as .ci/run has:
the tests fail, not skip, without it)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from backends import disk
from backends.base import BackendError, StoreFull, StoreReadOnly, StoreRefused
from backends.disk import DB_FILENAME, DiskBackend
from cacheproxy.edge.state import PROXY
from cacheproxy.keys import codec
from cacheproxy.keys.key import CacheKey
from cacheproxy.service import storage
from cacheproxy.service.memos import DecodedRecords
from cacheproxy.service.storage import StoreAccess
from policies.status import Reason
from tests.conftest import Proxy, ProxyFactory
from tests.contract.test_store_contract import FakeClock
from tests.e2e.test_operability import _metrics
from tests.harness.redis_fixtures import StartServer

CHAT = "/v1/chat/completions"




def _fill(directory: Path) -> int:
    """Fill the file system of `directory` to the brim with a junk file; its size."""
    written = 0
    with (directory / "junk").open("wb", buffering=0) as junk:
        try:
            while True:
                written += junk.write(b"\0" * 4096)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return written


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _truncate_wal(directory: Path) -> None:
    """Move every page of the WAL into the database file and empty the WAL (from another
    connection, as `cacheproxy` commands would), so the next write must grow the WAL: on a
    disk filled after this, every write is refused."""
    with contextlib.closing(sqlite3.connect(directory / DB_FILENAME,
                                            isolation_level=None)) as other:
        busy, _, _ = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    assert busy == 0, "the WAL could not be emptied"
    assert (directory / f"{DB_FILENAME}-wal").stat().st_size == 0


async def _ask(proxy: Proxy, content: str, **extra: Any) -> tuple[str, bytes]:
    """(X-Cache, body) of one chat request."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12, **extra}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Cache"], await resp.read()


def _choices(body: bytes) -> Any:
    return json.loads(body)["choices"]


STORED = [f"Where does the {animal} live?" for animal in ("fox", "owl", "cat")]


async def _store_some(proxy: Proxy) -> dict[str, bytes]:
    answers = {}
    for content in STORED:
        cache, answers[content] = await _ask(proxy, content)
        assert cache == "MISS"
    return answers


async def _stored_ones_hit(proxy: Proxy, answers: dict[str, bytes]) -> None:
    for content, first in answers.items():
        cache, again = await _ask(proxy, content)
        assert cache == "HIT", content
        assert _choices(again) == _choices(first)


async def test_a_full_disk_serves_every_stored_entry_and_says_store_full(
    make_proxy: ProxyFactory, tiny_disk: Path
) -> None:
    proxy = await make_proxy(store=f"disk://{tiny_disk}")
    answers = await _store_some(proxy)
    assert _fill(tiny_disk) > 0
    refused = None
    for i in range(30):  # (a write may still fit in a page the database file holds)
        cache, body = await _ask(proxy, f"What does the duck eat? ({i})")
        if cache != "MISS":
            refused = (f"What does the duck eat? ({i})", cache, body)
            break
    assert refused is not None, "every answer was stored on a full disk"
    content, cache, body = refused
    assert cache == "MISS; reason=store-full"
    again, body_again = await _ask(proxy, content)  # not stored: generated again, the same
    assert again == "MISS; reason=store-full"
    assert _choices(body_again) == _choices(body)
    # Streamed, the headers went out before the store refused: an SSE comment says it.
    cache, events = await _ask(proxy, content, stream=True)
    assert cache == "MISS" and b": x-cache=MISS; reason=store-full\n\n" in events
    await _stored_ones_hit(proxy, answers)
    m = await _metrics(proxy)
    assert m[("cacheproxy_store_writes_refused", (("reason", "store-full"),))] == 3
    assert m[("cacheproxy_requests_total", (("cache", "MISS"), ("endpoint", CHAT),
                                            ("reason", "store-full"), ("status", "200")))] == 3
    assert m[("cacheproxy_store_breaker_open", ())] == 0
    assert m[("cacheproxy_store_errors", ())] == 0  # full is not down


async def test_a_redis_at_maxmemory_serves_every_stored_entry_and_says_store_full(
    make_proxy: ProxyFactory, start_redis: StartServer
) -> None:
    """A Redis that may not evict (maxmemory-policy noeviction) and has no room left refuses
    writes with OOM: that is a full store, not an outage (the breaker stays closed)."""
    import redis

    server = start_redis("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    proxy = await make_proxy(store=f"{server.url}/0")
    answers = await _store_some(proxy)
    with redis.Redis.from_url(f"{server.url}/0") as client:
        def to_the_brim() -> None:  # large values, then small ones (buffers come and go)
            for size in (65536, 1024, 64):
                with contextlib.suppress(redis.exceptions.OutOfMemoryError):
                    for i in range(100000):
                        client.set(f"junk/{size}/{i}/{os.urandom(4).hex()}", b"x" * size)

        caches: list[str] = []
        # Until a write is refused (Redis frees buffers between the brim and the proxy's
        # write: on a busy machine a few writes still fit), at most 20 tries.
        while "MISS; reason=store-full" not in caches and len(caches) < 20:
            to_the_brim()
            caches.append((await _ask(proxy, f"What does the duck eat? ({len(caches)})"))[0])
    assert "MISS; reason=store-full" in caches, caches
    assert set(caches) <= {"MISS", "MISS; reason=store-full"}
    await _stored_ones_hit(proxy, answers)
    m = await _metrics(proxy)
    assert m[("cacheproxy_store_writes_refused", (("reason", "store-full"),))] >= 1
    assert m[("cacheproxy_store_breaker_open", ())] == 0
    assert m[("cacheproxy_store_errors", ())] == 0


async def test_a_read_only_store_serves_every_stored_entry_and_says_store_read_only(
    make_proxy: ProxyFactory, tiny_disk: Path
) -> None:
    writer = await make_proxy(store=f"disk://{tiny_disk}")
    answers = await _store_some(writer)
    await writer.stop()
    await writer.store.aclose()
    await asyncio.to_thread(subprocess.run, ["mount", "-o", "remount,ro", str(tiny_disk)],
                            check=True)
    proxy = await make_proxy(store=f"disk://{tiny_disk}")
    await _stored_ones_hit(proxy, answers)
    cache, _ = await _ask(proxy, "What does the duck eat?")
    assert cache == "MISS; reason=store-read-only"
    async with aiohttp.ClientSession() as session, \
            session.get(proxy.url + "/health") as resp:
        counters = (await resp.json())["counters"]
    assert counters["store_read_only"] == 1 and counters["store_errors"] == 0
    m = await _metrics(proxy)
    assert m[("cacheproxy_store_writes_refused", (("reason", "store-read-only"),))] == 1
    assert m[("cacheproxy_store_breaker_open", ())] == 0


async def _key_of(proxy: Proxy, content: str) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + CHAT, json=body) as resp:
        return resp.headers["X-Cache-Key"]


async def _breaker_closed_and_no_store_error(proxy: Proxy) -> dict[Any, float]:
    m = await _metrics(proxy)
    assert m[("cacheproxy_store_breaker_open", ())] == 0
    assert m[("cacheproxy_store_errors", ())] == 0
    return m


async def test_a_restart_on_a_full_disk_serves_every_stored_entry_then_heals(
    make_proxy: ProxyFactory, tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(#19 review) A store closed cleanly holds every entry in its file (no WAL); opening
    it writable on a full disk fails (no room for the shared-memory file: SQLITE_IOERR_SHMSIZE),
    which took the store for down (BYPASS) for good. It is opened read-only instead, serves
    what it holds, and once there is room again a write opens it writable."""
    monkeypatch.setattr(disk, "WRITABLE_RETRY", 0.0, raising=False)  # (tried at once)
    monkeypatch.setattr(storage, "REFUSED_BACKOFF", 0.0, raising=False)
    writer = await make_proxy(store=f"disk://{tiny_disk}")
    answers = await _store_some(writer)
    await writer.stop()
    await writer.store.aclose()
    assert _files(tiny_disk) == [DB_FILENAME]  # no WAL, no shared memory
    _fill(tiny_disk)
    proxy = await make_proxy(store=f"disk://{tiny_disk}")
    await _stored_ones_hit(proxy, answers)
    assert (await _ask(proxy, "What does the duck eat?"))[0] == "MISS; reason=store-full"
    await _breaker_closed_and_no_store_error(proxy)
    (tiny_disk / "junk").unlink()  # room again
    assert (await _ask(proxy, "What does the hen eat?"))[0] == "MISS"  # stored
    assert (await _ask(proxy, "What does the hen eat?"))[0] == "HIT"
    await _stored_ones_hit(proxy, answers)
    await _breaker_closed_and_no_store_error(proxy)


async def test_a_delete_a_full_disk_refuses_keeps_the_breaker_closed(
    make_proxy: ProxyFactory, tiny_disk: Path
) -> None:
    """(#19 review) A record that does not decode is deleted; on a full disk that delete is
    refused (SQLITE_FULL), which opened the breaker (every request BYPASS): it is logged and
    skipped, the answer is a MISS not stored, and the other entries are still HITs."""
    proxy = await make_proxy(store=f"disk://{tiny_disk}")
    answers = await _store_some(proxy)
    damaged = STORED[0]
    await proxy.store.set(await _key_of(proxy, damaged), b"not a record")
    _truncate_wal(tiny_disk)
    _fill(tiny_disk)
    with capture_logs() as logs:
        cache, body = await _ask(proxy, damaged)
    assert cache == "MISS; reason=store-full"
    assert _choices(body) == _choices(answers[damaged])
    # The lookup's delete refused, then the fill's recheck (its delete not offered, nor the
    # answer: refused a moment ago).
    assert [(e["event"], e.get("op")) for e in logs if e["event"].startswith(("store", "record"))
            ] == [("record_discarded", None), ("store_refused", "delete"),
                  ("record_discarded", None)]
    await _stored_ones_hit(proxy, {c: a for c, a in answers.items() if c != damaged})
    await _breaker_closed_and_no_store_error(proxy)


async def test_a_full_disk_is_not_written_to_for_a_while_and_warned_of_once(
    make_proxy: ProxyFactory, tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(#19 review) After the store refused a write, the next answers are not offered to it
    for a few seconds (each cost a failing transaction and a warning): they are served
    `MISS; reason=store-full` and counted the same, with one warning."""
    proxy = await make_proxy(store=f"disk://{tiny_disk}")
    answers = await _store_some(proxy)
    _truncate_wal(tiny_disk)
    _fill(tiny_disk)
    namespace = proxy.app[PROXY].runner.fingerprint().digest
    offered = []
    store_set = proxy.store.set

    async def counted(key: str, value: bytes, ttl: float | None = None) -> None:
        if key.startswith(namespace + "/"):  # (not the namespace registry's)
            offered.append(key)
        await store_set(key, value, ttl)

    monkeypatch.setattr(proxy.store, "set", counted)
    with capture_logs() as logs:
        caches = [(await _ask(proxy, f"What does the duck eat? ({i})"))[0] for i in range(5)]
    assert caches == ["MISS; reason=store-full"] * 5
    assert len(offered) == 1
    assert len([e for e in logs if e["event"] == "store_refused"]) == 1
    m = await _breaker_closed_and_no_store_error(proxy)
    assert m[("cacheproxy_store_writes_refused", (("reason", "store-full"),))] == 5
    assert m[("cacheproxy_requests_total", (("cache", "MISS"), ("endpoint", CHAT),
                                            ("reason", "store-full"), ("status", "200")))] == 5
    await _stored_ones_hit(proxy, answers)


# -- the disk store and the service's use of it, without HTTP -------------------------------


async def _fill_store(store: DiskBackend, entries: int = 20) -> dict[str, bytes]:
    values = {f"ns/{i}": b"v%d" % i for i in range(entries)}
    for key, value in values.items():
        await store.set(key, value)
    return values


async def _reopened_on_a_full_disk(directory: Path, clock: FakeClock
                                   ) -> tuple[DiskBackend, dict[str, bytes]]:
    """A store filled and closed cleanly, the disk then filled, the store opened again (on
    `clock`); and what it holds."""
    store = DiskBackend(directory, clock=clock)
    values = await _fill_store(store)
    await store.aclose()
    _fill(directory)
    return DiskBackend(directory, clock=clock), values


async def test_a_store_opened_on_a_full_disk_serves_read_only_then_heals(
    tiny_disk: Path
) -> None:
    clock = FakeClock()
    store, values = await _reopened_on_a_full_disk(tiny_disk, clock)
    try:
        with capture_logs() as logs:
            assert {k: await store.get(k) for k in values} == values
            with pytest.raises(StoreFull):
                await store.set("ns/new", b"v")
            with pytest.raises(StoreFull):
                await store.delete("ns/0")
        assert [e["event"] for e in logs] == ["disk_store_full"]
        assert not store.read_only  # full, which heals: not a read-only store
        (tiny_disk / "junk").unlink()
        clock.advance(disk.WRITABLE_RETRY - 0.5)
        with pytest.raises(StoreFull):  # not tried again before its time
            await store.set("ns/new", b"v")
        clock.advance(0.5)
        with capture_logs() as logs:
            await store.set("ns/new", b"new")
        assert [e["event"] for e in logs] == ["disk_store_writable"]
        assert await store.delete("ns/0")
        assert await store.get("ns/new") == b"new" and await store.get("ns/0") is None
        stats = await store.stats()
        assert (stats.entries, stats.bytes) == (20, sum(
            len(k) + len(v) for k, v in values.items() if k != "ns/0") + len("ns/new") + 3)
    finally:
        await store.aclose()


async def test_a_store_opened_on_a_full_disk_sees_a_purge_by_reads_alone(
    tiny_disk: Path
) -> None:
    """Opened read-only on a full disk (an immutable connection sees no other commit), the
    store heals on a read too: once there is room, a purge by another process is seen
    within WRITABLE_RETRY although nothing is written here; its own purge at once."""
    clock = FakeClock()
    store, values = await _reopened_on_a_full_disk(tiny_disk, clock)
    other = DiskBackend(tiny_disk)
    try:
        assert await store.get("ns/0") == values["ns/0"]  # read-only now
        (tiny_disk / "junk").unlink()
        assert await other.delete("ns/0")  # another process, with room again
        clock.advance(disk.WRITABLE_RETRY)
        assert await store.get("ns/0") is None, "a read-only store served a purged entry"
        assert await store.purge_namespace("ns") == len(values) - 1
        assert await store.get("ns/1") is None
    finally:
        await other.aclose()
        await store.aclose()


async def test_a_corrupt_file_met_read_only_is_quarantined_once_there_is_room(
    tiny_disk: Path
) -> None:
    """A read-only connection assumes the file never changes, so what it reads as damaged is
    not moved aside (it may be another process's write); once the disk has room the store
    opens it writable, finds the damage, and quarantines it as a writable store does."""
    store = DiskBackend(tiny_disk)
    for i in range(12):  # (few: a WAL of many commits would fill the 1 MB itself)
        await store.set(f"ns/{i}", os.urandom(1000))
    await store.aclose()
    assert _files(tiny_disk) == [DB_FILENAME]
    _fill(tiny_disk)
    with (tiny_disk / DB_FILENAME).open("r+b") as database:  # pages after the first two
        size = database.seek(0, os.SEEK_END)
        database.seek(8192)
        database.write(os.urandom(size - 8192))
    store = DiskBackend(tiny_disk)
    try:
        with pytest.raises(BackendError, match="malformed"):
            for i in range(12):
                await store.get(f"ns/{i}")
        assert not store.quarantined
        (tiny_disk / "junk").unlink()
        assert await store.get("ns/0") is None  # (quarantined: a fresh file)
        assert len(store.quarantined) == 1
        await store.set("ns/new", b"v")
        assert await store.get("ns/new") == b"v"
    finally:
        await store.aclose()


async def test_a_full_disk_whose_wal_holds_commits_is_not_read_without_them(
    tmp_path: Path, tiny_disk: Path
) -> None:
    """Without its WAL the file may be an older state, or half of a checkpoint: a store whose
    WAL holds frames (a writer killed, its shared memory gone) is not opened read-only from
    the file alone on a full disk; it stays a store error, and nothing is quarantined."""
    elsewhere = DiskBackend(tmp_path)
    await _fill_store(elsewhere)
    for suffix in ("", "-wal"):  # (as a crash leaves them: the WAL not checkpointed)
        (tiny_disk / (DB_FILENAME + suffix)).write_bytes(
            (tmp_path / (DB_FILENAME + suffix)).read_bytes())
    await elsewhere.aclose()
    assert (tiny_disk / f"{DB_FILENAME}-wal").stat().st_size > 32
    _fill(tiny_disk)
    store = DiskBackend(tiny_disk)
    try:
        with pytest.raises(BackendError) as caught:
            await store.get("ns/0")
        assert not isinstance(caught.value, StoreRefused)
        assert not store.quarantined
    finally:
        await store.aclose()


async def test_every_write_a_full_disk_refuses_is_store_full(tiny_disk: Path) -> None:
    """(#19 review) A delete too (it was a plain store error, and opened the breaker)."""
    store = DiskBackend(tiny_disk)
    try:
        values = await _fill_store(store)
        _truncate_wal(tiny_disk)
        _fill(tiny_disk)
        with pytest.raises(StoreFull):
            await store.delete("ns/0")
        with pytest.raises(StoreFull):
            await store.set("ns/new", b"v")
        assert {k: await store.get(k) for k in values} == values
    finally:
        await store.aclose()


@pytest.mark.parametrize(("code", "refusal"), [
    (sqlite3.SQLITE_FULL, StoreFull),
    (sqlite3.SQLITE_READONLY, StoreReadOnly),
    (sqlite3.SQLITE_READONLY_DIRECTORY, StoreReadOnly),
    (sqlite3.SQLITE_READONLY_CANTLOCK, None),
    (sqlite3.SQLITE_READONLY_RECOVERY, None),
    (sqlite3.SQLITE_READONLY_CANTINIT, None),
    (sqlite3.SQLITE_READONLY_DBMOVED, None),
    (sqlite3.SQLITE_READONLY_ROLLBACK, None),
    (sqlite3.SQLITE_IOERR_WRITE, None),
])
async def test_only_a_full_disk_or_a_read_only_database_is_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int,
    refusal: type[StoreRefused] | None
) -> None:
    """(#19 review) The other SQLITE_READONLY_* codes are faults (a lock or a recovery that
    failed, the file moved): store errors, so the breaker opens, not a store that "is"
    read-only. (Faked: SQLite gives them only in states a test cannot make on demand.)"""
    def failing(*_: object) -> None:
        exc = sqlite3.OperationalError("injected")
        exc.sqlite_errorcode = code
        raise exc

    store = DiskBackend(tmp_path)
    monkeypatch.setattr(store, "_insert", failing)
    try:
        with pytest.raises(BackendError) as caught:
            await store.set("ns/k", b"v")
        assert type(caught.value) is (refusal or BackendError)
    finally:
        await store.aclose()


def test_a_read_only_store_is_not_a_full_one() -> None:
    assert not issubclass(StoreReadOnly, StoreFull) and not issubclass(StoreFull, StoreReadOnly)
    assert issubclass(StoreReadOnly, StoreRefused) and issubclass(StoreFull, StoreRefused)


async def test_the_service_tries_a_refused_write_again_after_a_while(
    tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    store = DiskBackend(tiny_disk)
    access = StoreAccess(store, store_retry=60, ttl=None, decoded=DecodedRecords(),
                         clock=clock)
    record = codec.Record(request={}, output=codec.Output((), "length", 0, 0))
    try:
        assert await access.put(CacheKey("ns/0"), record) is None
        _truncate_wal(tiny_disk)
        _fill(tiny_disk)
        offered = []
        store_set = store.set

        async def counted(key: str, value: bytes, ttl: float | None = None) -> None:
            offered.append(key)
            await store_set(key, value, ttl)

        monkeypatch.setattr(store, "set", counted)
        with capture_logs() as logs:
            reasons = [await access.put(CacheKey(f"ns/{i}"), record) for i in range(1, 4)]
            clock.advance(storage.REFUSED_BACKOFF)
            reasons.append(await access.put(CacheKey("ns/4"), record))
        assert reasons == [Reason.STORE_FULL] * 4
        assert offered == ["ns/1", "ns/4"]
        assert [e["skipped"] for e in logs if e["event"] == "store_refused"] == [0, 2]
        assert access.counters["store_full"] == 4 and access.breaker.closed
    finally:
        await store.aclose()


async def test_a_read_the_store_refuses_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No StoreFull escapes the service's reads (it was raised as it is: a 500)."""
    store = DiskBackend(tmp_path)
    access = StoreAccess(store, store_retry=60, ttl=None, decoded=DecodedRecords())

    async def refused(key: str) -> bytes | None:
        raise StoreFull("full")

    monkeypatch.setattr(store, "get", refused)
    try:
        assert await access.get(CacheKey("ns/0")) is None
        assert access.breaker.closed
    finally:
        await store.aclose()
