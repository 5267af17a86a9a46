"""Tiered-specific behaviour: what L1 serves, when it fills, and how stale it may be.

The byte-level contract itself runs in tests/contract/test_store_contract.py (tiered over
disk and Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis

from backends import BackendError, MemoryBackend, TieredBackend, open_backend
from backends.redis_url import open_redis
from tests.conftest import eventually
from tests.contract.test_store_contract import FakeClock, settled
from tests.harness.redis_fixtures import StartServer
from tests.harness.redis_servers import (
    RedisClusterNodes,
    RedisServer,
    _cluster_ok,
    free_port,
    start_cluster,
)


class ProbedStore(MemoryBackend):
    """A MemoryBackend L2 that counts reads, can fail, and can hold a read in flight."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.reads = 0
        self.failing = False
        self.hold: asyncio.Event | None = None

    async def get(self, key: str) -> bytes | None:
        self.reads += 1
        if self.failing:
            raise BackendError("L2 is down")
        value = await super().get(key)
        if self.hold is not None:
            await self.hold.wait()  # the reply is on the wire while others write
        return value

    async def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        if self.failing:
            raise BackendError("L2 is down")
        await super().set(key, value, ttl)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def l2(clock: FakeClock) -> ProbedStore:
    return ProbedStore(clock)


def tiered(l2: MemoryBackend, clock: FakeClock, l1_ttl: float = 60.0) -> TieredBackend:
    return TieredBackend(MemoryBackend(max_bytes=10_000, clock=clock), l2, l1_ttl=l1_ttl)


async def test_l1_hit_never_touches_l2(l2: ProbedStore, clock: FakeClock) -> None:
    store = tiered(l2, clock)
    await store.set("k", b"v")
    l2.failing = True
    assert [await store.get("k") for _ in range(3)] == [b"v"] * 3
    assert l2.reads == 0
    with pytest.raises(BackendError):
        await store.get("other")  # an L1 miss needs L2


async def test_l2_hit_fills_l1(l2: ProbedStore, clock: FakeClock) -> None:
    store = tiered(l2, clock)
    await l2.set("k", b"from another replica")
    assert await store.get("k") == b"from another replica"
    assert await store.get("k") == b"from another replica"
    assert l2.reads == 1
    assert await store.l1.get("k") == b"from another replica"


async def test_peek_answers_from_l1_only(l2: ProbedStore, clock: FakeClock) -> None:
    store = tiered(l2, clock, l1_ttl=5)
    await l2.set("k", b"from another replica")
    assert store.peek("k") is None  # held in L2 only: peek cannot tell, get reads it
    assert await store.get("k") == b"from another replica"
    assert store.peek("k") == b"from another replica" and l2.reads == 1
    clock.advance(5)
    assert store.peek("k") is None  # L1 dropped it after l1_ttl; L2 still holds it
    assert await store.get("k") == b"from another replica" and l2.reads == 2


async def test_l1_keeps_entries_at_most_l1_ttl(l2: ProbedStore, clock: FakeClock) -> None:
    store = tiered(l2, clock, l1_ttl=5)
    await store.set("forever", b"v")
    await store.set("short", b"v", ttl=2)
    clock.advance(2)
    assert await store.l1.get("short") is None
    assert await store.l1.get("forever") == b"v"
    clock.advance(3)
    assert await store.l1.get("forever") is None
    assert await store.get("forever") == b"v"  # refilled from L2
    assert l2.reads == 1


async def test_another_replicas_delete_is_seen_within_l1_ttl(
    l2: ProbedStore, clock: FakeClock
) -> None:
    ours, theirs = tiered(l2, clock, l1_ttl=5), tiered(l2, clock, l1_ttl=5)
    await ours.set("k", b"v")
    assert await theirs.delete("k") is True
    assert await ours.get("k") == b"v"  # bounded staleness: our L1 was not told
    clock.advance(5)
    assert await ours.get("k") is None


async def test_fill_racing_a_delete_is_dropped(l2: ProbedStore, clock: FakeClock) -> None:
    store = tiered(l2, clock)
    await l2.set("k", b"old")
    l2.hold = asyncio.Event()
    reader = asyncio.create_task(store.get("k"))
    await asyncio.sleep(0)  # the read of "old" is in flight
    assert await store.delete("k") is True
    l2.hold.set()
    assert await reader == b"old"  # it was true when read...
    assert await store.l1.get("k") is None  # ...but it is not cached past the delete
    l2.hold = None
    assert await store.get("k") is None


async def test_failed_l2_write_leaves_no_l1_copy(l2: ProbedStore, clock: FakeClock) -> None:
    store = tiered(l2, clock)
    await store.set("k", b"old")
    l2.failing = True
    with pytest.raises(BackendError):
        await store.set("k", b"new")
    assert await store.l1.get("k") is None
    l2.failing = False
    assert await store.get("k") == b"old"


async def test_purge_empties_both_tiers(l2: ProbedStore, clock: FakeClock) -> None:
    store = tiered(l2, clock)
    for key in ("ns/1", "ns/2", "keep/1"):
        await store.set(key, b"v")
    assert await store.purge_namespace("ns") == 2
    assert await store.l1.scan("") == ["keep/1"]
    assert await l2.scan("") == ["keep/1"]


async def test_l1_hit_survives_a_stopped_redis(start_redis: StartServer) -> None:
    server = start_redis()
    store = open_backend(f"tiered+{server.url}/0?socket_timeout=0.3&l1_max_bytes=100000")
    try:
        await store.set("hot", b"v")
        assert await store.get("hot") == b"v"  # copied into L1 by a (tracked) read
        server.stop()
        assert await store.get("hot") == b"v"
        with pytest.raises(BackendError):
            await store.get("cold")
    finally:
        await store.aclose()


# --- Coherence: over one Redis server, every change reaches every replica's L1 ------------


class TrackingStore(ProbedStore):
    """A ProbedStore that can tell its reader about changes, by hand: the real server cannot
    be made to push an invalidation at a chosen moment of a read in flight."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.changed: Callable[[str | None], None] = lambda key: None
        self.restarted: Callable[[], None] = lambda: None
        self.tracking = True
        self.tracking_refused: str | None = None

    def track(self, changed: Callable[[str | None], None], restarted: Callable[[], None]) -> bool:
        self.changed, self.restarted = changed, restarted
        return True

    async def get_with_ttl(self, key: str) -> tuple[bytes | None, float | None]:
        return await self.get(key), None


def tracking_clients(server: RedisServer) -> list[int]:
    """The ids of the server's connections with CLIENT TRACKING on."""
    with server.client() as client:
        return [c["id"] for c in client.client_list() if "t" in c["flags"]]


async def test_a_fill_racing_an_invalidation_is_dropped(clock: FakeClock) -> None:
    l2 = TrackingStore(clock)
    store = tiered(l2, clock)
    assert store.coherent
    await l2.set("k", b"old")
    l2.hold = asyncio.Event()
    reader = asyncio.create_task(store.get("k"))
    await asyncio.sleep(0)  # the read of "old" is in flight
    l2.changed("k")  # another replica wrote "k": its invalidation overtakes our read
    l2.hold.set()
    assert await reader == b"old"
    assert store.peek("k") is None
    l2.hold = asyncio.Event()
    reader = asyncio.create_task(store.get("k"))
    await asyncio.sleep(0)
    l2.changed("other")  # a change to another key does not hold this fill back,
    await store.set("other", b"x")  # nor a write of one here
    l2.hold.set()
    assert await reader == b"old" and store.peek("k") == b"old"
    l2.changed("k")
    l2.hold = None
    assert await store.get("k") == b"old" and store.peek("k") == b"old"
    l2.changed("other")
    assert store.peek("k") == b"old"  # only what changed is dropped...
    l2.changed(None)
    assert store.peek("k") is None  # ...or everything, on a flush


async def test_a_restart_empties_l1_but_lets_reads_in_flight_fill(clock: FakeClock) -> None:
    l2 = TrackingStore(clock)
    store = tiered(l2, clock)
    await l2.set("a", b"1")
    await l2.set("b", b"2")
    assert await store.get("a") == b"1"
    l2.hold = asyncio.Event()
    reader = asyncio.create_task(store.get("b"))
    await asyncio.sleep(0)
    l2.restarted()  # a new tracked connection: what L1 held is tracked no more...
    assert store.peek("a") is None
    l2.hold.set()
    assert await reader == b"2"
    assert store.peek("b") == b"2"  # ...but a read on the new connection is


async def test_own_writes_are_not_copied_into_l1_when_coherent(clock: FakeClock) -> None:
    l2 = TrackingStore(clock)
    store = tiered(l2, clock)
    await store.set("k", b"v")
    assert store.peek("k") is None and l2.reads == 0  # not tracked until read
    assert await store.get("k") == b"v" and store.peek("k") == b"v" and l2.reads == 1
    await store.set("k", b"w")
    assert store.peek("k") is None  # the old copy goes at once, before the write is done
    assert await store.get("k") == b"w"


Change = Callable[[TieredBackend, redis.Redis], Awaitable[None]]


async def _overwrite(other: TieredBackend, raw: redis.Redis) -> None:
    await other.set("ns/k", b"new")


async def _delete(other: TieredBackend, raw: redis.Redis) -> None:
    assert await other.delete("ns/k")


async def _purge(other: TieredBackend, raw: redis.Redis) -> None:
    assert await other.purge_namespace("ns") == 1


async def _another_client(other: TieredBackend, raw: redis.Redis) -> None:
    raw.set("ns/k", b"new")


async def _expiry(other: TieredBackend, raw: redis.Redis) -> None:
    raw.pexpire("ns/k", 50)


async def _flush(other: TieredBackend, raw: redis.Redis) -> None:
    raw.flushall()


@pytest.mark.parametrize("change", [_overwrite, _delete, _purge, _another_client, _expiry,
                                    _flush], ids=lambda f: f.__name__.strip("_"))
async def test_a_change_anywhere_reaches_every_replicas_l1(
    start_redis: StartServer, change: Change
) -> None:
    server = start_redis()
    ours = open_backend(f"tiered+{server.url}/0?l1_ttl=3600")
    theirs = open_backend(f"tiered+{server.url}/0?l1_ttl=3600")
    assert isinstance(ours, TieredBackend) and isinstance(theirs, TieredBackend)
    try:
        assert ours.coherent and theirs.coherent
        assert await ours.get("absent") is None and ours.coherence == "tracked"
        await theirs.set("ns/k", b"old")
        assert await ours.get("ns/k") == b"old" and ours.peek("ns/k") == b"old"
        with server.client() as raw:
            await change(theirs, raw)
            await eventually(lambda: ours.peek("ns/k") is None)
            assert await ours.get("ns/k") == raw.get("ns/k")
    finally:
        await ours.aclose()
        await theirs.aclose()


async def test_an_eviction_reaches_l1(start_redis: StartServer) -> None:
    server = start_redis("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    store = open_backend(f"tiered+{server.url}/0")
    try:
        await store.set("ns/k", b"v")
        assert await store.get("ns/k") == b"v" and store.peek("ns/k") == b"v"
        with server.client() as raw:
            filler = 0
            while raw.exists("ns/k"):
                raw.set(f"filler/{filler}", bytes(10_000))
                filler += 1
                assert filler < 10_000, "the server never evicted the key"
        await eventually(lambda: store.peek("ns/k") is None)
    finally:
        await store.aclose()


async def test_tracking_resumes_on_its_own_after_the_connection_breaks(
    start_redis: StartServer,
) -> None:
    server = start_redis()
    store = open_backend(f"tiered+{server.url}/0?l1_ttl=3600")
    try:
        await store.set("ns/k", b"v")
        assert await store.get("ns/k") == b"v"
        [tracked] = tracking_clients(server)
        with server.client() as raw:
            raw.client_kill_filter(_id=tracked)
        # No GET follows: the lane reconnects by itself, and L1 drops what the broken
        # connection tracked (a change in between would have gone unheard).
        await eventually(lambda: tracking_clients(server) not in ([], [tracked]))
        await eventually(lambda: store.peek("ns/k") is None)
        assert await store.get("ns/k") == b"v" and store.peek("ns/k") == b"v"
        with server.client() as raw:
            raw.set("ns/k", b"new")  # heard on the new connection
        await eventually(lambda: store.peek("ns/k") is None)
    finally:
        await store.aclose()
    assert tracking_clients(server) == []  # closed with the store


async def test_l1_serves_through_a_redis_restart_then_tracks_again(
    start_redis: StartServer,
) -> None:
    server = start_redis()
    store = open_backend(f"tiered+{server.url}/0?l1_ttl=3600&socket_timeout=0.3")
    try:
        await store.set("ns/k", b"v")
        assert await store.get("ns/k") == b"v"
        server.stop()
        await asyncio.sleep(0.3)  # reconnects are refused meanwhile
        assert store.peek("ns/k") == b"v"  # hot keys survive the outage (for l1_ttl)
        server.start()  # empty: nothing it held survived
        await eventually(lambda: store.peek("ns/k") is None, within=5)
        assert await store.get("ns/k") is None
    finally:
        await store.aclose()


async def test_a_server_refusing_to_track_leaves_l1_bounded_by_l1_ttl(
    start_redis: StartServer,
) -> None:
    server = start_redis()
    with server.client() as raw:
        raw.acl_setuser("plain", enabled=True, passwords=["+pw"], keys=["*"],
                        commands=["+@all", "-client"])
    clock = FakeClock()
    l2 = open_redis(f"redis://plain:pw@127.0.0.1:{server.port}/0")
    store = TieredBackend(MemoryBackend(clock=clock), l2, l1_ttl=5)
    try:
        assert await store.get("absent") is None  # the lane's first connection: refused
        await store.set("ns/k", b"v")
        assert store.peek("ns/k") == b"v"  # untracked: its own writes are copied, as before
        assert "NOPERM" in (l2.tracking_refused or "") and not l2.tracking
        assert store.coherence.startswith("bounded by l1_ttl (the server refused")
        with server.client() as raw:
            raw.set("ns/k", b"new")
        await asyncio.sleep(0.2)
        assert store.peek("ns/k") == b"v"  # not told: stale for at most l1_ttl
        clock.advance(5)
        assert store.peek("ns/k") is None
        assert await store.get("ns/k") == b"new"
    finally:
        await store.aclose()


async def test_only_a_tiered_store_asks_for_invalidations(
    start_redis: StartServer, tmp_path: Path
) -> None:
    server = start_redis()
    plain = open_backend(server.url + "/0")
    disk = open_backend(f"tiered+disk://{tmp_path}")
    assert isinstance(disk, TieredBackend)
    try:
        assert await plain.get("k") is None
        assert tracking_clients(server) == []  # the plain store asks for no invalidations
        assert not disk.coherent  # a disk: bounded by l1_ttl, as the docstring says
        assert disk.coherence.startswith("bounded by l1_ttl (DiskBackend(")
    finally:
        await plain.aclose()
        await disk.aclose()


async def test_over_a_cluster_a_change_on_any_primary_reaches_the_other_l1(
    redis_cluster_url: str, redis_cluster: RedisClusterNodes
) -> None:
    ours = open_backend(f"tiered+{redis_cluster_url}&l1_ttl=3600")
    theirs = open_backend(f"tiered+{redis_cluster_url}&l1_ttl=3600")
    assert isinstance(ours, TieredBackend) and isinstance(theirs, TieredBackend)
    keys = [f"ns/{i}" for i in range(30)]  # spread over the three primaries' slots
    try:
        for key in keys:
            await theirs.set(key, b"old")
        assert await ours.get("ns/warm-up") is None  # opens a tracked lane per primary
        await eventually(lambda: ours.coherence == "tracked")
        assert [await ours.get(key) for key in keys] == [b"old"] * 30
        assert all(ours.peek(key) == b"old" for key in keys)
        for key in keys[:10]:
            await theirs.set(key, b"new")
        for key in keys[10:20]:
            assert await theirs.delete(key)
        for server in redis_cluster.servers:  # another client, on every primary
            with server.client() as raw:
                for key in keys[20:]:
                    with contextlib.suppress(redis.ResponseError):  # MOVED: not this one's
                        raw.set(key, b"raw")
        await eventually(lambda: all(ours.peek(key) is None for key in keys))
        assert [await ours.get(key) for key in keys] == \
            [b"new"] * 10 + [None] * 10 + [b"raw"] * 10
    finally:
        await ours.aclose()
        await theirs.aclose()


async def test_over_a_cluster_a_primary_tracking_anew_empties_l1(
    redis_cluster_url: str, redis_cluster: RedisClusterNodes
) -> None:
    store = open_backend(f"tiered+{redis_cluster_url}&l1_ttl=3600")
    assert isinstance(store, TieredBackend)
    try:
        await store.set("ns/k", b"v")
        assert await store.get("ns/k") == b"v"
        await eventually(lambda: store.coherence == "tracked")
        assert await store.get("ns/k") == b"v" and store.peek("ns/k") == b"v"
        server = redis_cluster.servers[1]
        await eventually(lambda: len(tracking_clients(server)) == 1)  # earlier tests' gone
        [tracked] = tracking_clients(server)
        with server.client() as raw:
            raw.client_kill_filter(_id=tracked)
        # Changes on that primary went unheard meanwhile: L1 lets go of everything.
        await eventually(lambda: store.peek("ns/k") is None)
        await eventually(lambda: store.coherence == "tracked")
        assert tracking_clients(server) not in ([], [tracked])
    finally:
        await store.aclose()
    await eventually(lambda: all(tracking_clients(s) == [] for s in redis_cluster.servers))


class Blackhole:
    """A TCP relay to a server that can go silent without closing anything: the fault of a
    network cut, which a local server cannot make (a stopped one closes its sockets)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self.silent = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._port)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            if not self.silent:
                sink.write(data)
        sink.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()


async def test_a_silent_connection_is_found_and_tracking_resumes(
    start_redis: StartServer,
) -> None:
    server = start_redis()
    relay = Blackhole(server.port)
    port = await relay.start()
    store = open_backend(f"tiered+redis://127.0.0.1:{port}/0?l1_ttl=3600&socket_timeout=0.2"
                         "&socket_connect_timeout=0.2")
    assert isinstance(store, TieredBackend)
    try:
        await store.set("ns/k", b"old")
        assert await store.get("ns/k") == b"old" and store.coherence == "tracked"
        relay.silent = True  # no GET follows: only the lane's heartbeat can tell
        with server.client() as raw:
            raw.set("ns/k", b"new")  # its invalidation is lost on the way
        await eventually(lambda: store.coherence != "tracked", within=3)
        assert store.peek("ns/k") == b"old"  # served on, for at most l1_ttl
        relay.silent = False
        await eventually(lambda: store.peek("ns/k") is None, within=5)
        assert await store.get("ns/k") == b"new" and store.coherence == "tracked"
    finally:
        await store.aclose()
        await relay.aclose()


async def test_a_tracked_connection_outlives_the_servers_idle_timeout(
    start_redis: StartServer,
) -> None:
    server = start_redis("--timeout", "2")
    store = open_backend(f"tiered+{server.url}/0?l1_ttl=3600")
    assert isinstance(store, TieredBackend)
    try:
        await store.set("ns/k", b"v")
        assert await store.get("ns/k") == b"v"
        [tracked] = tracking_clients(server)
        await asyncio.sleep(3.5)  # hits answered from L1 only: the lane is otherwise idle
        assert tracking_clients(server) == [tracked] and store.peek("ns/k") == b"v"
    finally:
        await store.aclose()


async def test_a_server_stalled_for_less_than_three_timeouts_keeps_l1(
    start_redis: StartServer,
) -> None:
    server = start_redis("--enable-debug-command", "yes")
    store = open_backend(f"tiered+{server.url}/0?l1_ttl=3600&socket_timeout=0.5")
    assert isinstance(store, TieredBackend)
    try:
        await store.set("ns/hot", b"v")
        assert await store.get("ns/hot") == b"v"
        [tracked] = tracking_clients(server)
        with server.client() as raw:
            # Timeline (s): the server sleeps from ~0 to 1.5; the first GET goes at 0.2 and
            # times out at 0.7, the second at 1.2; the connection would be given up at 1.7.
            stall = asyncio.create_task(asyncio.to_thread(raw.execute_command,
                                                          "DEBUG", "SLEEP", "1.5"))
            await asyncio.sleep(0.2)
            with pytest.raises(BackendError, match="Timeout"):
                await store.get("ns/cold")  # this caller waited its socket_timeout...
            assert store.coherence.startswith("connecting")  # (a reply is late)
            started = time.monotonic()
            with pytest.raises(BackendError, match="Timeout"):
                await store.get("ns/cold")  # a second caller waits its own, no longer
            assert time.monotonic() - started < 0.8
            await stall
        assert await store.get("ns/cold") is None  # ...the connection did not need to go
        assert tracking_clients(server) == [tracked] and store.peek("ns/hot") == b"v"
        assert store.coherence == "tracked"
    finally:
        await store.aclose()


async def test_a_read_on_a_connection_killed_under_it_is_retried(
    start_redis: StartServer,
) -> None:
    server = start_redis()
    store = open_backend(f"tiered+{server.url}/0")
    try:
        await store.set("ns/k", b"v")
        assert await store.get("ns/other") is None
        [tracked] = tracking_clients(server)
        with server.client() as raw:
            raw.client_kill_filter(_id=tracked)  # the loop has not seen the close yet
        assert await store.get("ns/k") == b"v"  # sent, lost, sent again on a new connection
    finally:
        await store.aclose()


async def test_an_l1_copy_never_outlives_the_entry_in_redis(redis_url: str) -> None:
    clock = FakeClock()
    store = TieredBackend(MemoryBackend(clock=clock), open_redis(redis_url), l1_ttl=3600)
    try:
        await store.set("ns/k", b"v", ttl=60)
        assert await store.get("ns/k") == b"v" and store.peek("ns/k") == b"v"
        clock.advance(60)  # Redis may not have deleted it yet (it expires lazily)...
        assert store.peek("ns/k") is None  # ...but L1 was told its life with the value
    finally:
        await store.aclose()


async def test_a_closed_store_stops_reconnecting(start_redis: StartServer) -> None:
    server = start_redis()
    store = open_backend(f"tiered+{server.url}/0")
    try:
        assert await store.get("ns/k") is None
        [tracked] = tracking_clients(server)
        with server.client() as raw:
            raw.client_kill_filter(_id=tracked)
    finally:
        await store.aclose()  # while its reconnect is due
    await asyncio.sleep(0.3)
    assert tracking_clients(server) == []


async def test_over_tls_a_change_reaches_the_other_l1(redis_tls_url: str) -> None:
    ours = open_backend(f"tiered+{redis_tls_url}&l1_ttl=3600")
    theirs = open_backend(f"tiered+{redis_tls_url}&l1_ttl=3600")
    assert isinstance(ours, TieredBackend) and isinstance(theirs, TieredBackend)
    try:
        await theirs.set("ns/k", b"old")
        assert await ours.get("ns/k") == b"old" and ours.coherence == "tracked"
        assert await theirs.delete("ns/k")
        await eventually(lambda: ours.peek("ns/k") is None)
    finally:
        await ours.aclose()
        await theirs.aclose()


async def test_over_a_cluster_a_primary_met_through_moved_is_tracked(
    redis_binary: str, tmp_path: Path
) -> None:
    cluster = start_cluster(redis_binary, tmp_path, primaries=1)
    old_primary = cluster.servers[0]
    port = free_port(with_bus=True)
    new_primary = RedisServer(redis_binary, port, tmp_path, (
        "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"))
    cluster.servers.append(new_primary)
    ours = theirs = None
    try:
        new_primary.start()
        with old_primary.client() as raw:
            raw.execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        deadline = time.monotonic() + 20
        while not all(_cluster_ok(server, 2) for server in cluster.servers):
            assert time.monotonic() < deadline, "the second node never joined"
            await asyncio.sleep(0.1)
        ours = open_backend(f"tiered+{cluster.url}?l1_ttl=3600")
        theirs = open_backend(f"tiered+{cluster.url}?l1_ttl=3600")
        assert isinstance(ours, TieredBackend)
        await theirs.set("ns/k", b"old")
        await settled(ours)
        assert await ours.get("ns/k") == b"old"
        with old_primary.client() as source, new_primary.client() as target:  # reshard
            slot = source.execute_command("CLUSTER", "KEYSLOT", "ns/k")
            source_id = source.execute_command("CLUSTER", "MYID").decode()
            target_id = target.execute_command("CLUSTER", "MYID").decode()
            target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            source.execute_command("MIGRATE", "127.0.0.1", port, "ns/k", 0, 5000)
            for node in (target, source):
                node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        await eventually(lambda: ours.peek("ns/k") is None)  # gone from the old primary
        assert await ours.get("ns/k") == b"old"  # read through MOVED from the new primary...
        await eventually(lambda: ours.coherence == "tracked")  # ...which is tracked now
        assert await ours.get("ns/k") == b"old" and ours.peek("ns/k") == b"old"
        await theirs.set("ns/k", b"new")
        await eventually(lambda: ours.peek("ns/k") is None)
        assert await ours.get("ns/k") == b"new"
    finally:
        for store in (ours, theirs):
            if store is not None:
                await store.aclose()
        for server in cluster.servers:
            server.stop()
