"""Tiered-specific behaviour: what L1 serves, when it fills, and how stale it may be.

The byte-level contract itself runs in tests/test_backends.py (tiered over disk and Redis).
"""

from __future__ import annotations

import asyncio

import pytest

from backends import BackendError, MemoryBackend, TieredBackend, open_backend
from tests.conftest_redis import StartServer
from tests.test_backends import FakeClock


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
        server.stop()
        assert await store.get("hot") == b"v"
        with pytest.raises(BackendError):
            await store.get("cold")
    finally:
        await store.aclose()
