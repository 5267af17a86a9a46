"""One contract suite for every backend, then disk-specific and URL tests.

The contract runs against memory, disk, Redis, Redis Cluster and tiered (over disk and over
Redis). A test marked @needs(...) runs only on the kinds with those capabilities:
  clock        time is the injected FakeClock (exact expiry boundaries, lazy expiry counts)
  exact_bytes  stats().bytes is the sum of keys + values (Redis reports used_memory)
  max_bytes    the URL's max_bytes bounds the store and stats() reports it
  lru          eviction is exact LRU on max_bytes (Redis evicts approximately, by maxmemory)
  peek         values held in process memory are read without I/O (memory, tiered's L1)
  ordered      scan() lists keys in key order (Redis lists them from a SCAN cursor)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import pytest_asyncio

from backends import (
    Backend,
    BackendError,
    DiskBackend,
    MemoryBackend,
    NamespacePurge,
    RedisBackend,
    StoreStats,
    StoreStatsResult,
    TieredBackend,
    default_disk_url,
    disk,
    disk_recency,
    listing,
    open_backend,
)
from backends.base import (
    PURGE_BATCH,
    NamespaceStats,
    Peek,
    Scan,
    ScanPages,
    StoreReadOnly,
    entry_size,
)
from backends.disk import DB_FILENAME
from backends.disk_purger import Purger
from backends.disk_recency import WRITE_EVERY
from tests.conftest import eventually
from tests.harness.redis_fixtures import together

OpenStore = Callable[..., Backend]
_F = TypeVar("_F", bound=Callable[..., object])


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@dataclass(frozen=True)
class Kind:
    """One kind of store the contract runs against, and what it can promise."""

    name: str
    capabilities: frozenset[str]

    @property
    def tick(self) -> float:
        """A time step: one fake-clock second, or 0.1 s of real time for server-side expiry."""
        return 1.0 if "clock" in self.capabilities else 0.1


_LOCAL = frozenset({"clock", "exact_bytes", "max_bytes", "lru", "ordered"})
KINDS = [
    Kind("memory", _LOCAL | {"peek"}),
    Kind("disk", _LOCAL),
    Kind("tiered-disk", _LOCAL - {"lru"} | {"peek"}),  # L1 may still serve what L2 evicted
    Kind("redis", frozenset()),
    Kind("redis-cluster", frozenset()),
    Kind("tiered-redis", frozenset({"peek"})),
    Kind("tiered-redis-cluster", frozenset({"peek"})),
    Kind("redis-tls", frozenset()),
    Kind("tiered-redis-tls", frozenset({"peek"})),
]


def needs(*capabilities: str) -> Callable[[_F], _F]:
    """Run this contract test only on the kinds that have every one of capabilities."""

    def mark(test: _F) -> _F:
        test.needs = frozenset(capabilities)  # type: ignore[attr-defined]
        return test

    return mark


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kind" in metafunc.fixturenames:
        needed = getattr(metafunc.function, "needs", frozenset())
        kinds = [kind for kind in KINDS if needed <= kind.capabilities]
        metafunc.parametrize("kind", kinds, ids=[kind.name for kind in kinds])


def _store_url(kind: Kind, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    disk = f"disk://{tmp_path / 'store'}"
    urls = {
        "memory": lambda: "memory://",
        "disk": lambda: disk,
        "tiered-disk": lambda: f"tiered+{disk}?l1_max_bytes=1048576",
        "redis": lambda: request.getfixturevalue("redis_url"),
        "redis-cluster": lambda: request.getfixturevalue("redis_cluster_url"),
        "tiered-redis": lambda: "tiered+" + request.getfixturevalue("redis_url"),
        "tiered-redis-cluster": lambda: "tiered+" + request.getfixturevalue("redis_cluster_url"),
        "redis-tls": lambda: request.getfixturevalue("redis_tls_url"),
        "tiered-redis-tls": lambda: "tiered+" + request.getfixturevalue("redis_tls_url"),
    }
    return urls[kind.name]()


@pytest_asyncio.fixture
async def open_store(
    kind: Kind, request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> AsyncIterator[OpenStore]:
    """A factory for stores of the parametrized kind, all closed at teardown."""
    opened: list[Backend] = []
    url = _store_url(kind, request, tmp_path)

    def make(max_bytes: int | None = None) -> Backend:
        query = "" if max_bytes is None else f"max_bytes={max_bytes}"
        if query and "max_bytes" not in kind.capabilities:
            raise AssertionError(f"{kind.name} takes no max_bytes: mark the test @needs")
        joined = url + ("&" if "?" in url else "?") + query if query else url
        backend = open_backend(joined, clock=clock if "clock" in kind.capabilities else time.time)
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        await backend.aclose()


@pytest.fixture
def store(open_store: OpenStore) -> Backend:
    return open_store()


async def settled(store: TieredBackend) -> None:
    """Until the store's tracking is up: a read while it starts is (rightly) not kept in L1
    on a cluster, whose tracked connections starting anew empty L1 and drop fills in flight."""
    assert await store.get("warm-up") is None
    await eventually(lambda: store.coherence == "tracked", within=5, every=0.01)


async def elapse(kind: Kind, clock: FakeClock, ticks: float) -> None:
    """Let ticks of the kind's time pass: move the fake clock, or really wait."""
    if "clock" in kind.capabilities:
        clock.advance(ticks * kind.tick)
    else:
        await asyncio.sleep(ticks * kind.tick)


async def stats_of(backend: Backend) -> tuple[int, int]:
    assert isinstance(backend, StoreStats)
    result = await backend.stats()
    return result.entries, result.bytes


async def assert_holds(kind: Kind, backend: Backend, entries: int, nbytes: int) -> None:
    """The store counts entries, and exactly nbytes where byte accounting is exact."""
    held, held_bytes = await stats_of(backend)
    if "exact_bytes" in kind.capabilities:
        assert (held, held_bytes) == (entries, nbytes)
    else:
        assert held == entries


@pytest.mark.asyncio
class TestBackendContract:
    async def test_capabilities(self, store: Backend) -> None:
        assert isinstance(store, Backend)
        assert isinstance(store, NamespacePurge)
        assert isinstance(store, StoreStats)
        assert isinstance(store, Scan | ScanPages)
        assert isinstance(store, NamespaceStats)

    async def test_peek_is_offered_where_values_are_held_in_process(
        self, kind: Kind, store: Backend
    ) -> None:
        assert isinstance(store, Peek) == ("peek" in kind.capabilities)

    @needs("peek")
    async def test_peek_never_sees_more_than_get(
        self, kind: Kind, store: Backend, clock: FakeClock
    ) -> None:
        assert isinstance(store, Peek)
        if isinstance(store, TieredBackend) and store.coherent:
            await settled(store)
        assert store.peek("k") is None
        await store.set("k", b"v", ttl=2 * kind.tick)
        assert await store.get("k") == b"v" == store.peek("k")  # held here once read
        await elapse(kind, clock, 3)
        assert store.peek("k") is None and await store.get("k") is None
        await store.set("k", b"w")
        await store.delete("k")
        assert store.peek("k") is None
        await store.set("k", b"x")
        await store.aclose()
        with pytest.raises(BackendError):
            store.peek("k")

    async def test_missing_key_is_none(self, store: Backend) -> None:
        assert await store.get("nope") is None

    async def test_roundtrip_and_overwrite(self, kind: Kind, store: Backend) -> None:
        await store.set("k", b"one")
        assert await store.get("k") == b"one"
        await store.set("k", b"two!")
        assert await store.get("k") == b"two!"
        await assert_holds(kind, store, 1, len("k") + len(b"two!"))

    async def test_delete_reports_presence(self, store: Backend) -> None:
        await store.set("k", b"v")
        assert await store.delete("k") is True
        assert await store.get("k") is None
        assert await store.delete("k") is False

    async def test_every_byte_value_and_empty_value(self, store: Backend) -> None:
        every_byte = bytes(range(256)) * 3
        await store.set("bin", every_byte)
        await store.set("empty", b"")
        assert await store.get("bin") == every_byte
        assert await store.get("empty") == b""

    async def test_large_value(self, store: Backend) -> None:
        big = bytes(range(256)) * (5 * 1024 * 1024 // 256)
        await store.set("big", big)
        assert await store.get("big") == big

    async def test_unicode_key_counts_utf8_bytes(self, kind: Kind, store: Backend) -> None:
        await store.set("ns/ключ", b"v")
        assert await store.get("ns/ключ") == b"v"
        await assert_holds(kind, store, 1, len("ns/ключ".encode()) + 1)
        assert isinstance(store, NamespaceStats)
        assert await store.namespace_stats("ns") == (1, len("ns/ключ".encode()) + 1)

    async def test_ttl_expires(self, kind: Kind, store: Backend, clock: FakeClock) -> None:
        await store.set("short", b"v", ttl=2 * kind.tick)
        await store.set("forever", b"v")
        assert await store.get("short") == b"v"
        await elapse(kind, clock, 3)
        assert await store.get("short") is None
        assert await store.get("forever") == b"v"
        await assert_holds(kind, store, 1, len("forever") + 1)

    @needs("clock", "exact_bytes")
    async def test_ttl_expires_lazily_on_read(self, store: Backend, clock: FakeClock) -> None:
        await store.set("short", b"v", ttl=10)
        await store.set("forever", b"v")
        clock.advance(9.5)
        assert await store.get("short") == b"v"
        clock.advance(0.5)
        assert await stats_of(store) == (2, 2 * (5 + 1) + 2)  # not swept, only read-expired
        assert await store.get("short") is None
        assert await stats_of(store) == (1, len("forever") + 1)
        clock.advance(10**9)
        assert await store.get("forever") == b"v"

    async def test_overwrite_replaces_ttl(
        self, kind: Kind, store: Backend, clock: FakeClock
    ) -> None:
        await store.set("k", b"v", ttl=kind.tick)
        await store.set("k", b"w")
        await elapse(kind, clock, 2)
        assert await store.get("k") == b"w"

    async def test_delete_of_expired_entry_is_false(
        self, kind: Kind, store: Backend, clock: FakeClock
    ) -> None:
        await store.set("k", b"v", ttl=kind.tick)
        await elapse(kind, clock, 1.5)
        assert await store.delete("k") is False
        await assert_holds(kind, store, 0, 0)

    @pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf")])
    async def test_bad_ttl_is_rejected_and_changes_nothing(
        self, store: Backend, ttl: float
    ) -> None:
        await store.set("k", b"v")
        with pytest.raises(ValueError, match="ttl"):
            await store.set("k", b"w", ttl=ttl)
        assert await store.get("k") == b"v"

    @needs("lru")
    async def test_lru_eviction_respects_reads(
        self, open_store: OpenStore, clock: FakeClock
    ) -> None:
        entry = len("k0") + 100
        store = open_store(max_bytes=3 * entry)
        for name in ("k0", "k1", "k2"):
            await store.set(name, b"x" * 100)
            clock.advance(1)
        assert await store.get("k0") is not None  # k0 is now the most recent
        clock.advance(1)
        await store.set("k3", b"x" * 100)
        assert await store.get("k1") is None
        assert [await store.get(k) is not None for k in ("k0", "k2", "k3")] == [True] * 3
        assert await stats_of(store) == (3, 3 * entry)

    @needs("lru")
    async def test_eviction_frees_enough_for_a_big_value(
        self, open_store: OpenStore, clock: FakeClock
    ) -> None:
        store = open_store(max_bytes=1000)
        for i in range(9):
            await store.set(f"k{i}", b"x" * 98)
            clock.advance(1)
        await store.set("big", b"y" * 697)
        assert await stats_of(store) == (4, 3 * 100 + 700)
        assert await store.get("k5") is None
        assert await store.get("k6") is not None

    @needs("lru")
    async def test_value_over_max_bytes_is_not_stored(self, open_store: OpenStore) -> None:
        store = open_store(max_bytes=1000)
        await store.set("small", b"s")
        await store.set("stale", b"old")
        await store.set("huge", b"h" * 1000)  # 4 + 1000 bytes > 1000
        await store.set("stale", b"z" * 1000)
        assert await store.get("huge") is None
        assert await store.get("stale") is None  # never serve the value a set replaced
        assert await store.get("small") == b"s"
        assert await stats_of(store) == (1, len("small") + 1)

    async def test_purge_namespace_only_touches_that_namespace(
        self, kind: Kind, store: Backend
    ) -> None:
        for key in ("a/1", "a/2", "a/x/3", "ab/4", "a", "b/a/5", "a0"):
            await store.set(key, b"v")
        assert isinstance(store, NamespacePurge)
        assert await store.purge_namespace("a") == 3
        assert [await store.get(k) for k in ("a/1", "a/2", "a/x/3")] == [None] * 3
        for key in ("ab/4", "a", "b/a/5", "a0"):
            assert await store.get(key) == b"v"
        assert await store.purge_namespace("a") == 0
        kept = ("ab/4", "a", "b/a/5", "a0")
        await assert_holds(kind, store, 4, sum(len(k) + 1 for k in kept))

    async def test_purge_treats_pattern_characters_literally(self, store: Backend) -> None:
        for key in ("a*/1", "ab/1", "a?/1", "a[b]/1", "ab]/1", "a\\/1", "a\\x/1"):
            await store.set(key, b"v")
        assert isinstance(store, NamespacePurge)
        assert await store.purge_namespace("a*") == 1
        assert await store.purge_namespace("a?") == 1
        assert await store.purge_namespace("a[b]") == 1
        assert await store.purge_namespace("a\\") == 1
        assert await listing.keys(store, "a") == sorted(["ab/1", "ab]/1", "a\\x/1"])

    async def test_purge_of_a_large_namespace_runs_in_batches(
        self, kind: Kind, store: Backend
    ) -> None:
        for i in range(PURGE_BATCH * 2 + 7):
            await store.set(f"big/{i:05d}", b"v")
        await store.set("keep/1", b"v")
        assert isinstance(store, NamespacePurge)
        assert await store.purge_namespace("big") == PURGE_BATCH * 2 + 7
        await assert_holds(kind, store, 1, len("keep/1") + 1)

    @needs("ordered")
    async def test_scan_pages_through_a_prefix_in_key_order(self, store: Backend) -> None:
        for key in ("n/3", "n/1", "n/2", "m/1", "n0", "o/1"):
            await store.set(key, b"v")
        assert isinstance(store, Scan)
        assert await store.scan("n/") == ["n/1", "n/2", "n/3"]
        assert await store.scan("n/", limit=2) == ["n/1", "n/2"]
        assert await store.scan("n/", after="n/2") == ["n/3"]
        assert await store.scan("", limit=100) == sorted(["n/3", "n/1", "n/2", "m/1", "n0", "o/1"])

    async def test_listing_gives_every_key_of_a_prefix_in_pages_of_about_the_limit(
        self, store: Backend
    ) -> None:
        wanted = {f"n/{i:04d}" for i in range(250)}
        for key in [*wanted, "m/1", "n0", "o/1"]:
            await store.set(key, b"v")
        got: list[str] = []
        sizes = []
        async for chunk in listing.pages(store, "n/", limit=40):
            got += chunk
            sizes.append(len(chunk))
        assert set(got) == wanted  # (SCAN may list a key twice: pages, not a set)
        # COUNT is a hint: SCAN returns about 40 keys a call, more while Redis rehashes.
        assert len(sizes) >= 2 and max(sizes) < 4 * 40
        assert await listing.keys(store, "n/") == sorted(wanted)
        assert await listing.keys(store, "") == sorted([*wanted, "m/1", "n0", "o/1"])
        assert await listing.keys(store, "zz/") == []

    async def test_a_sample_lists_only_the_pages_it_needs(self, store: Backend) -> None:
        names = [f"s/{i * (2**128 // 1000):032x}" for i in range(1000)]  # spread, as hashes are
        for key in [*names, "t/1"]:
            await store.set(key, b"v")
        listed = 0
        real_page = listing.page

        async def counted(*args: object, **kwargs: object) -> tuple[list[str], str]:
            nonlocal listed
            keys, cursor = await real_page(*args, **kwargs)  # type: ignore[arg-type]
            listed += len(keys)
            return keys, cursor

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(listing, "page", counted)
            picks = [await listing.sample(store, "s/", 20, random.Random(seed))
                     for seed in range(3)]
            assert listed < 3 * 500  # a few pages of 100 each, not the 1000 keys
            everything = await listing.sample(store, "s/", 2000, random.Random(0))
        assert all(len(p) == 20 == len(set(p)) and set(p) <= set(names) for p in picks)
        assert len({tuple(p) for p in picks}) == 3  # from a random point each time
        assert everything == sorted(names)  # fewer than asked: all of them, once each

    async def test_namespace_stats_counts_one_namespace(self, store: Backend) -> None:
        for key, value in (("n/1", b"ab"), ("n/2", b"abc"), ("m/1", b"x")):
            await store.set(key, value)
        assert isinstance(store, NamespaceStats)
        assert await store.namespace_stats("n") == (2, 3 + 2 + 3 + 3)
        assert await store.namespace_stats("zz") == (0, 0)

    @needs("max_bytes")
    async def test_stats_reports_bound(self, open_store: OpenStore) -> None:
        store = open_store(max_bytes=12345)
        assert isinstance(store, StoreStats)
        result = await store.stats()
        assert (result.entries, result.bytes, result.max_bytes) == (0, 0, 12345)

    async def test_concurrent_writers_all_land(self, kind: Kind, store: Backend) -> None:
        keys = [f"ns/{i}" for i in range(50)]
        await together(store.set(k, k.encode() * 10) for k in keys)
        values = await asyncio.gather(*(store.get(k) for k in keys))
        assert values == [k.encode() * 10 for k in keys]
        await assert_holds(kind, store, 50, sum(len(k) * 11 for k in keys))
        assert isinstance(store, NamespaceStats)
        assert await store.namespace_stats("ns") == (50, sum(len(k) * 11 for k in keys))

    async def test_closed_store_raises_backend_error(self, store: Backend) -> None:
        await store.aclose()
        await store.aclose()  # idempotent
        with pytest.raises(BackendError):
            await store.get("k")
        with pytest.raises(BackendError):
            await store.set("k", b"v")




@pytest.mark.asyncio
class TestDiskBackend:
    async def test_persists_across_reopen(self, tmp_path: Path, clock: FakeClock) -> None:
        first = DiskBackend(tmp_path, clock=clock)
        await first.set("ns/a", b"alpha", ttl=100)
        await first.set("ns/b", b"beta")
        await first.aclose()
        second = DiskBackend(tmp_path, clock=clock)
        try:
            assert await second.get("ns/a") == b"alpha"
            assert await second.get("ns/b") == b"beta"
            clock.advance(100)
            assert await second.get("ns/a") is None  # absolute expiry survives a restart
        finally:
            await second.aclose()

    async def test_byte_total_is_rebuilt_on_reopen(self, tmp_path: Path, clock: FakeClock) -> None:
        first = DiskBackend(tmp_path, max_bytes=300, clock=clock)
        for i in range(3):
            await first.set(f"k{i}", b"x" * 98)
            clock.advance(1)
        before = await first.stats()
        await first.aclose()
        second = DiskBackend(tmp_path, max_bytes=300, clock=clock)
        try:
            assert await second.stats() == before
            assert before.bytes == 300
            await second.set("k3", b"x" * 98)  # must evict, which needs the right total
            assert await second.get("k0") is None
            assert (await second.stats()).bytes == 300
        finally:
            await second.aclose()

    async def test_byte_total_follows_another_process(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        server = DiskBackend(tmp_path, max_bytes=300, clock=clock)
        cli = DiskBackend(tmp_path, max_bytes=300, clock=clock)
        try:
            for i in range(3):
                await server.set(f"old/{i}", b"x" * 95)
                clock.advance(1)
            assert await cli.purge_namespace("old") == 3
            assert await server.stats() == StoreStatsResult(0, 0, 300)
            await server.set("new/a", b"x" * 95)
            await server.set("new/b", b"x" * 95)  # no stale total, so nothing is evicted
            assert await server.get("new/a") is not None
        finally:
            await server.aclose()
            await cli.aclose()

    async def test_a_purge_runs_in_a_process_of_its_own(self, tmp_path: Path) -> None:
        """(#18 cost curves) On a thread of the serving process a 1M purge raised the GET p99
        of other namespaces 2.6-3.7x (it shared the interpreter with them); from another
        process 1.2x. So its batches run in a child, one per step, gone with the purge."""
        store = DiskBackend(tmp_path)
        try:
            for i in range(PURGE_BATCH + 1):
                await store.set(f"big/{i:04d}", b"v")
            await store.set("keep/1", b"v")
            pids: list[int] = []
            step = store._purge_step

            async def watched(purger: Purger) -> int:
                pids.append(purger.pid)
                return await step(purger)

            store._purge_step = watched  # type: ignore[method-assign]
            assert await store.purge_namespace("big") == PURGE_BATCH + 1
            assert len(pids) == 2 and pids[0] == pids[1] != os.getpid()
            with pytest.raises(ProcessLookupError):
                os.kill(pids[0], 0)  # ended and reaped
            assert not store._purgers
            assert await store.stats() == StoreStatsResult(1, len("keep/1") + 1,
                                                           store.max_bytes)
            assert await store.get("keep/1") == b"v"
        finally:
            await store.aclose()

    async def test_closing_the_store_ends_a_purge_under_way(self, tmp_path: Path) -> None:
        store = DiskBackend(tmp_path)
        for i in range(PURGE_BATCH * 3):
            await store.set(f"big/{i:04d}", b"v")
        first, release = asyncio.Event(), asyncio.Event()
        pids: list[int] = []
        step = store._purge_step

        async def held(purger: Purger) -> int:
            removed = await step(purger)
            pids.append(purger.pid)
            first.set()
            await release.wait()
            return removed

        store._purge_step = held  # type: ignore[method-assign]
        purge = asyncio.create_task(store.purge_namespace("big"))
        await first.wait()
        await store.aclose()  # the child, idle between two steps, ends at once
        with pytest.raises(ProcessLookupError):
            os.kill(pids[0], 0)
        release.set()
        with pytest.raises(BackendError, match="closed"):
            await purge
        reopened = DiskBackend(tmp_path)  # one batch went, the rest is there
        try:
            assert (await reopened.stats()).entries == PURGE_BATCH * 2
        finally:
            await reopened.aclose()

    async def test_a_purge_whose_process_dies_fails_and_the_next_one_works(
        self, tmp_path: Path
    ) -> None:
        store = DiskBackend(tmp_path)
        try:
            for i in range(PURGE_BATCH * 2):
                await store.set(f"big/{i:04d}", b"v")
            step = store._purge_step

            async def killed(purger: Purger) -> int:
                removed = await step(purger)
                os.kill(purger.pid, signal.SIGKILL)
                return removed

            store._purge_step = killed  # type: ignore[method-assign]
            with pytest.raises(BackendError, match="the purge process ended: exit code -9"):
                await store.purge_namespace("big")
            del store._purge_step
            assert await store.purge_namespace("big") == PURGE_BATCH
        finally:
            await store.aclose()

    async def test_a_purge_reports_sqlites_error_as_the_store_error_it_is(
        self, tmp_path: Path
    ) -> None:
        """The child's SQLite error comes back with its code: a database locked past the busy
        timeout is a fault (BackendError), a full disk would be StoreFull."""
        store = DiskBackend(tmp_path)
        try:
            await store.set("big/1", b"v")
            monkey = pytest.MonkeyPatch()
            monkey.setattr(disk, "_BUSY_TIMEOUT_S", 0.05)
            other = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")
                with pytest.raises(BackendError, match="database is locked") as raised:
                    await store.purge_namespace("big")
                assert type(raised.value) is BackendError
                assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
                assert raised.value.__cause__.sqlite_errorcode == sqlite3.SQLITE_BUSY
                other.execute("ROLLBACK")
            finally:
                other.close()
                monkey.undo()
            assert await store.purge_namespace("big") == 1
        finally:
            await store.aclose()

    async def test_a_purge_of_a_store_that_never_stored_anything_is_empty(
        self, tmp_path: Path
    ) -> None:
        store = DiskBackend(tmp_path / "never")
        try:
            assert await store.purge_namespace("ns") == 0
            assert not (tmp_path / "never").exists()
        finally:
            await store.aclose()

    async def test_another_connections_commit_costs_no_table_scan(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """(#18 cost curves) The byte total lives in the database (triggers): after another
        connection's commit a read takes it in O(1) instead of summing every row (~400 ms at
        a million entries, on the serving process's next read)."""
        server = DiskBackend(tmp_path, clock=clock)
        cli = DiskBackend(tmp_path, clock=clock)
        try:
            for i in range(50):
                await server.set(f"old/{i}", b"x" * 90)
            statements: list[str] = []
            await server._run(lambda conn: conn.set_trace_callback(statements.append))
            assert await cli.purge_namespace("old") == 50
            assert await server.get("old/0") is None
            assert (await server.stats()).bytes == 0
            assert not [q for q in statements if "SUM(" in q.upper()], statements
        finally:
            await server.aclose()
            await cli.aclose()

    async def test_a_database_of_an_earlier_version_gets_its_total(self, tmp_path: Path) -> None:
        with contextlib.closing(sqlite3.connect(tmp_path / DB_FILENAME,
                                                isolation_level=None)) as old:
            old.execute("CREATE TABLE entries (key TEXT PRIMARY KEY, size INTEGER NOT NULL,"
                        " expires_at REAL, accessed_at REAL NOT NULL, value BLOB NOT NULL)")
            old.executemany("INSERT INTO entries VALUES (?, ?, NULL, 0, ?)",
                            [(f"k{i}", 10 + i, b"v") for i in range(5)])
        store = DiskBackend(tmp_path)
        try:
            assert (await store.stats()).bytes == sum(10 + i for i in range(5))
            await store.set("new", b"v" * 10)
            assert (await store.stats()).bytes == sum(10 + i for i in range(5)) + 13
        finally:
            await store.aclose()

    async def test_committed_set_is_visible_without_close(self, tmp_path: Path) -> None:
        writer = DiskBackend(tmp_path)
        reader = DiskBackend(tmp_path)
        try:
            await writer.set("k", b"durable")
            # As if the writer's process died here: a second connection sees the commit.
            assert await reader.get("k") == b"durable"
        finally:
            await writer.aclose()
            await reader.aclose()

    async def test_database_is_in_wal_mode(self, tmp_path: Path) -> None:
        store = DiskBackend(tmp_path / "deep" / "dir")
        await store.set("k", b"v")
        await store.aclose()
        with sqlite3.connect(tmp_path / "deep" / "dir" / DB_FILENAME) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)

    async def test_a_garbage_database_is_quarantined_and_a_fresh_one_started(
        self, tmp_path: Path
    ) -> None:
        """(#19) At start-up: the file is moved aside (named with the time), a fresh one
        serves, and it says so (the proxy no longer stays in BYPASS for good)."""
        garbage = b"this is not a database\x00\xff" * 400
        (tmp_path / DB_FILENAME).write_bytes(garbage)
        store = DiskBackend(tmp_path)
        try:
            assert await store.get("k") is None
            await store.set("k", b"v")
            assert await store.get("k") == b"v"
            (aside,) = store.quarantined
            assert aside.name.startswith(f"{DB_FILENAME}.corrupt-") and \
                aside.read_bytes() == garbage
        finally:
            await store.aclose()

    async def test_a_database_corrupted_while_serving_heals(self, tmp_path: Path) -> None:
        store = DiskBackend(tmp_path)
        try:
            for i in range(200):
                await store.set(f"ns/{i}", os.urandom(2000))
            await store.aclose()
            store = DiskBackend(tmp_path)
            assert await store.get("ns/0") is not None  # serving, its connection open
            database = tmp_path / DB_FILENAME
            with database.open("r+b") as f:  # pages overwritten under it
                f.seek(8192)
                f.write(os.urandom(200_000))
            # Another process commits (as `cacheproxy purge` would): the store's connection
            # reads the file again, and meets the damage.
            with contextlib.closing(sqlite3.connect(database, isolation_level=None)) as other:
                other.execute("PRAGMA user_version = 7")
            answers = [await store.get(f"ns/{i}") for i in range(200)]  # no error raised
            assert len(store.quarantined) == 1, "the corruption was not detected"
            assert answers == [None] * 200  # the old entries went with the file
            await store.set("ns/new", b"v")
            assert await store.get("ns/new") == b"v"
        finally:
            await store.aclose()

    async def test_unusable_directory_raises_backend_error(self, tmp_path: Path) -> None:
        not_a_dir = tmp_path / "file"
        not_a_dir.write_bytes(b"")
        store = DiskBackend(not_a_dir)
        try:
            with pytest.raises(BackendError) as caught:
                await store.set("k", b"v")
            assert isinstance(caught.value.__cause__, OSError)
        finally:
            await store.aclose()

    async def test_a_full_disk_keeps_every_stored_entry_readable(
        self, tiny_disk: Path, clock: FakeClock
    ) -> None:
        """(#19) Reads never write: on a 1 MB tmpfs filled to the brim every stored entry is
        still read (its recency update, batched off the read, is dropped)."""
        store = DiskBackend(tiny_disk, max_bytes=64 << 20, clock=clock)  # bound: the disk
        try:
            stored = []
            with pytest.raises(BackendError, match="full"):
                for i in range(1000):
                    await store.set(f"ns/{i}", os.urandom(8192))
                    stored.append(f"ns/{i}")
            assert len(stored) > 20
            for key in stored:
                clock.advance(WRITE_EVERY)  # every read records its recency, and flushes
                assert await store.get(key) is not None, key
            await store.aclose()
            assert store.touches_dropped > 0  # the writes were tried, and failed, off the reads
        finally:
            await store.aclose()

    async def test_a_listing_page_far_into_a_prefix_costs_what_the_first_does(
        self, tmp_path: Path
    ) -> None:
        """(#18 cost curves) Listing 1M entries page by page took 33 s: each page's query
        read every key from the prefix's start up to the page."""
        store = DiskBackend(tmp_path)
        try:
            await store.set("ns/000000", b"v")
            with contextlib.closing(sqlite3.connect(tmp_path / DB_FILENAME,
                                                    isolation_level=None)) as other:
                other.execute("BEGIN")  # one transaction (one commit, not 20k)
                other.executemany("INSERT INTO entries (key, size, expires_at, accessed_at,"
                                  " value) VALUES (?, 1, NULL, 0, x'00')",
                                  [(f"ns/{i:06d}",) for i in range(1, 20_000)])
                other.execute("COMMIT")
            steps = [0]

            def counted() -> int:
                steps[0] += 1
                return 0

            async def cost(after: str) -> tuple[int, list[str]]:
                steps[0] = 0
                await store._run(lambda conn: conn.set_progress_handler(counted, 100))
                page = await store.scan("ns/", after=after, limit=100)
                await store._run(lambda conn: conn.set_progress_handler(None, 0))
                return steps[0], page

            first, _ = await cost("")
            last, page = await cost("ns/019800")
            assert page == [f"ns/{i:06d}" for i in range(19_801, 19_901)]
            assert last < 3 * first + 5, (first, last)
        finally:
            await store.aclose()

    async def test_recencies_are_written_off_the_reads_and_wait_for_a_lock_not_them(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """(#18 cost curves) The recencies reads record were written on the store's one
        thread, ahead of the next reads: 35-60 ms for 256 at a million entries, up to 1.3 s
        while a purge held the write lock, every GET behind them. They are written on a
        thread and connection of their own: reads go on while the write waits for a lock;
        none is dropped, and a write (which evicts) waits for them first."""
        store = DiskBackend(tmp_path, clock=clock)
        other = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
        try:
            for i in range(300):
                await store.set(f"ns/{i}", b"v")
            clock.advance(WRITE_EVERY)
            read_at = clock()
            other.execute("BEGIN IMMEDIATE")  # a purge's batch, say, holds the write lock
            started = time.monotonic()
            for _ in range(3):
                for i in range(300):  # 256 recencies make a write, which waits for the lock
                    assert await store.get(f"ns/{i}") == b"v"
            assert time.monotonic() - started < 1.0
            writing = asyncio.create_task(store.set("ns/new", b"v"))
            await asyncio.sleep(0.2)
            assert not writing.done()  # (it waits for the recencies in flight, then the lock)
            other.execute("COMMIT")
            await writing
            assert await store.get("ns/new") == b"v"
            assert store.touches_dropped == 0
            (read,) = other.execute("SELECT COUNT(*) FROM entries WHERE accessed_at = ?"
                                    " AND key != 'ns/new'", (read_at,)).fetchone()
            assert read == 300
        finally:
            other.close()
            await store.aclose()

    async def test_eviction_sees_the_recencies_in_flight(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """A read's recency may be on its way (written off the store's thread) when a write
        evicts: the write waits for it, so the entry just read is not the one evicted."""
        size = entry_size("ns/0", b"v" * 100)
        store = DiskBackend(tmp_path, max_bytes=3 * size, clock=clock)
        try:
            for i in range(3):
                await store.set(f"ns/{i}", b"v" * 100)
                clock.advance(1)
            write = store._recencies._write

            def slow(batch: dict[str, float]) -> None:
                time.sleep(0.3)
                write(batch)

            store._recencies._write = slow  # type: ignore[method-assign]
            clock.advance(WRITE_EVERY)
            assert await store.get("ns/0") is not None  # the oldest, read: handed off
            await store.set("ns/3", b"v" * 100)  # evicts the least recent: ns/1
            assert await store.get("ns/0") is not None
            assert await store.get("ns/1") is None
        finally:
            await store.aclose()

    async def test_a_write_evicts_by_the_total_after_another_process_purged(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """(review) A write may wait (for the recencies in flight, for the lock) while a
        purge in another process commits: it evicts by the byte total as it is then, not as
        it was when the write began, so no live entry goes for room already freed."""
        size = entry_size("ns/0", b"v" * 100)
        store = DiskBackend(tmp_path, max_bytes=10 * size, clock=clock)
        other = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None,
                                check_same_thread=False)  # (used on the recency thread)
        try:
            for i in range(10):  # full
                await store.set(f"ns/{i}", b"v" * 100)
                clock.advance(1)
            write = store._recencies._write

            def purged_meanwhile(batch: dict[str, float]) -> None:
                other.execute("DELETE FROM entries WHERE key >= 'ns/5'")  # ns/5..ns/9
                write(batch)

            store._recencies._write = purged_meanwhile  # type: ignore[method-assign]
            clock.advance(WRITE_EVERY)
            assert await store.get("ns/0") is not None  # handed off: the purge commits then
            await store.set("ns/a", b"v" * 100)  # room for it: nothing is evicted
            assert [await store.get(f"ns/{i}") is not None for i in range(5)] == [True] * 5
            assert await store.stats() == StoreStatsResult(6, 6 * size, 10 * size)
        finally:
            other.close()
            await store.aclose()

    async def test_recencies_are_written_on_their_own_thread_and_bounded_while_they_wait(
        self, tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import threading

        monkeypatch.setattr(disk_recency, "PENDING_LIMIT", 20)
        store = DiskBackend(tmp_path, clock=clock)
        other = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
        try:
            for i in range(40):
                await store.set(f"ns/{i}", b"v" * 100)
            clock.advance(WRITE_EVERY)
            write, threads = store._recencies._write, []

            def recorded(batch: dict[str, float]) -> None:
                threads.append(threading.current_thread().name)
                write(batch)

            store._recencies._write = recorded  # type: ignore[method-assign]
            other.execute("BEGIN IMMEDIATE")
            assert await store.get("ns/0") is not None  # due (its time): handed off, waits
            await eventually(lambda: bool(threads))
            for i in range(1, 40):  # 20 wait for the next write, 19 are dropped
                assert await store.get(f"ns/{i}") is not None
            other.execute("COMMIT")
            await store.aclose()
            assert threads == ["cacheproxy-recency_0"]  # (the 20 were written at close)
            assert store.touches_dropped == 19
            (read,) = other.execute("SELECT COUNT(*) FROM entries WHERE accessed_at = ?",
                                    (clock(),)).fetchone()
            assert read == 21
        finally:
            other.close()
            await store.aclose()

    async def test_a_read_only_store_serves_what_it_holds(self, tiny_disk: Path) -> None:
        """(#19) A store on a file system remounted read-only: its entries are read (no
        SIGBUS, no 'unable to open database file'), new ones refused as store errors, a purge
        as the refusal it is."""
        store = DiskBackend(tiny_disk)
        for i in range(20):
            await store.set(f"ns/{i}", b"v%d" % i)
        await store.aclose()
        await asyncio.to_thread(subprocess.run, ["mount", "-o", "remount,ro", str(tiny_disk)],
                                check=True)
        store = DiskBackend(tiny_disk)
        try:
            assert [await store.get(f"ns/{i}") for i in range(20)] == \
                [b"v%d" % i for i in range(20)]
            assert store.read_only
            with pytest.raises(BackendError):
                await store.set("ns/new", b"v")
            with pytest.raises(StoreReadOnly, match="read-only: nothing can be purged"):
                await store.purge_namespace("ns")
            assert await store.get("ns/3") == b"v3"
        finally:
            await store.aclose()

    async def test_construction_touches_no_files(self, tmp_path: Path) -> None:
        store = DiskBackend(tmp_path / "lazy")
        await store.aclose()
        assert not (tmp_path / "lazy").exists()


class TestOpenBackend:
    def test_memory_url(self) -> None:
        backend = open_backend("memory://?max_bytes=1234")
        assert isinstance(backend, MemoryBackend)
        assert backend.max_bytes == 1234
        assert isinstance(open_backend("memory://"), MemoryBackend)

    def test_disk_url(self, tmp_path: Path) -> None:
        backend = open_backend(f"disk://{tmp_path}/with%20space?max_bytes=99")
        assert isinstance(backend, DiskBackend)
        assert backend.directory == tmp_path / "with space"
        assert backend.max_bytes == 99

    def test_default_disk_url_is_absolute(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg cache"))
        url = default_disk_url()
        assert url.startswith("disk:///")
        backend = open_backend(url)
        assert isinstance(backend, DiskBackend)
        assert backend.directory.is_absolute()
        assert backend.directory.name == "store"

    @pytest.mark.parametrize(
        ("url", "message"),
        [
            ("disk://relative/dir", "must be absolute"),
            ("disk:relative/dir", "must be absolute"),
            ("disk://", "must be absolute"),
            ("disk:///tmp/x?max_bytes=abc", "positive integer"),
            ("disk:///tmp/x?max_bytes=0", "positive integer"),
            ("disk:///tmp/x?max_bytes=-5", "positive integer"),
            ("disk:///tmp/x?max_bytes=", "positive integer"),
            ("disk:///tmp/x?max_size=5", "unknown parameter"),
            ("memory://?max_bytes=1&max_bytes=2", "more than once"),
            ("memory://host", "no host or path"),
            ("memory://?max_bytes=1#frag", "fragment"),
            ("ftp://example.com/x", "unknown scheme"),
            ("/just/a/path", "unknown scheme"),
            ("", "unknown scheme"),
            ("redis://", "host is required"),
            ("redis://h:notaport/0", "bad port"),
            ("redis://h:6379/zero", "database number"),
            ("redis://h:6379/0?socket_timeout=0", "positive number"),
            ("redis://h:6379/0?socket_timeout=abc", "positive number"),
            ("redis://h:6379/0?socket_connect_timeout=-1", "positive number"),
            ("redis://h:6379/0?max_connections=0", "positive integer"),
            ("redis://h:6379/0?max_connections=2.5", "positive integer"),
            ("redis://h:6379/0?max_connections=1&max_connections=2", "more than once"),
            ("redis://h:6379/0?pool=3", "unknown parameter"),
            ("redis://h:6379/0?ssl_ca_certs=/x", "unknown parameter"),
            ("redis://h:6379/0#frag", "fragment"),
            ("unix://host/run/redis.sock", "unix:///absolute"),
            ("unix:///run/redis.sock?db=x", "positive integer"),
            ("redis+cluster://h:7000/3", "only database 0"),
            ("redis+cluster://:7000", "host is required"),
            ("tiered+", "write tiered"),
            ("tiered+tiered+memory://", "write tiered"),
            ("tiered+memory://?l1_max_bytes=0", "positive integer"),
            ("tiered+memory://?l1_ttl=nan", "positive number"),
            ("tiered+memory://?l1_size=5", "unknown parameter"),
            ("tiered+memory://?l1_ttl=1&l1_ttl=2", "more than once"),
            ("tiered+ftp://x", "unknown scheme"),
        ],
    )
    def test_bad_urls_name_the_url(self, url: str, message: str) -> None:
        with pytest.raises(ValueError, match=message) as caught:
            open_backend(url)
        assert repr(url) in str(caught.value)

    def test_redis_password_never_shows(self) -> None:
        url = "redis://user:s3cret@h:6379/zero"
        with pytest.raises(ValueError, match="database number") as caught:
            open_backend(url)
        assert "s3cret" not in str(caught.value)
        assert "user:***@h" in str(caught.value)

    @pytest.mark.parametrize(
        "url",
        [
            "redis://localhost:6379/0",
            "redis://localhost",
            "redis://u:p@localhost:6379/2?socket_timeout=0.5&socket_connect_timeout=2",
            "rediss://localhost:6380/0?ssl_cert_reqs=none&max_connections=8",
            "unix:///run/redis.sock?db=3",
            "redis+cluster://localhost:7000",
            "rediss+cluster://localhost:7000?ssl_cert_reqs=optional",
        ],
    )
    async def test_redis_urls_open_without_connecting(self, url: str) -> None:
        backend = open_backend(url)
        assert isinstance(backend, RedisBackend)
        assert "u:p@" not in repr(backend)
        await backend.aclose()
        with pytest.raises(BackendError, match="closed"):
            await backend.get("k")

    async def test_tiered_url_splits_its_options_from_l2(self, tmp_path: Path) -> None:
        backend = open_backend(
            f"tiered+disk://{tmp_path}?max_bytes=5000&l1_max_bytes=300&l1_ttl=2.5"
        )
        try:
            assert isinstance(backend, TieredBackend)
            assert backend.l1.max_bytes == 300
            assert isinstance(backend.l2, DiskBackend)
            assert backend.l2.directory == tmp_path
            assert backend.l2.max_bytes == 5000
            assert "l1_ttl=2.5" in repr(backend)
        finally:
            await backend.aclose()


@pytest.mark.parametrize("store_kind", ["memory", "disk", "tiered-disk", "redis", "redis-cluster"])
async def test_a_purge_awaits_its_pause_between_two_steps_only(
        store_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """`pause` (what a load test pauses a purge with) is awaited between two steps of a
    purge, never before the first or after the last; the purge still removes everything."""
    url = {"memory": "memory://", "disk": f"disk://{tmp_path}",
           "tiered-disk": f"tiered+disk://{tmp_path}",
           "redis": request.getfixturevalue("redis_url") if store_kind == "redis" else "",
           "redis-cluster": request.getfixturevalue("redis_cluster_url")
           if store_kind == "redis-cluster" else ""}[store_kind]
    store = open_backend(url)
    assert isinstance(store, NamespacePurge)
    try:
        count = 2 * PURGE_BATCH + 1  # three steps of the largest batch any store takes
        await together(store.set(f"ns/{i:05d}", b"x") for i in range(count))
        await store.set("other/1", b"kept")
        left: list[bool] = []

        async def pause() -> None:  # is some of the namespace still there?
            for i in range(count):
                if await store.get(f"ns/{i:05d}") is not None:
                    left.append(True)
                    return
            left.append(False)

        assert await store.purge_namespace("ns", pause=pause) == count
        assert len(left) >= 2 and left[:2] == [True, True]  # between steps, not at the end
        if store_kind.startswith("redis"):
            # SCAN's cursor may have buckets to visit after the last key went: the steps
            # that find nothing still rest, so the last pauses may see the namespace gone.
            assert left == sorted(left, reverse=True)
        else:
            assert all(left)  # between steps: something was always left
        assert await store.get("ns/00000") is None and await store.get("other/1") == b"kept"
    finally:
        await store.aclose()
