"""The Redis commands that visit every primary: purge, scan and stats.

Every other command of the Redis store touches a single key, so keys need no hash tags on a
cluster; only these walk the whole keyspace (SCAN, in batches) or ask every primary (DBSIZE,
INFO). Plain functions of a redis-py client: RedisBackend (backends/redis.py) calls them
under its guard, which refuses a closed store, takes an in-flight slot and turns failures
into BackendError. Evictions are the server's maxmemory policy, so the store's max_bytes
(stats) is whatever maxmemory says.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from backends.base import PURGE_BATCH, BackendError, PurgePause, StoreStatsResult
from backends.resp import GetLane

Client = Redis | RedisCluster
_SCAN_COUNT = 1000
_PAGE_SCANS = 8  # SCANs per page at most: a sparse prefix gives short pages, each bounded
# A purge runs while the store serves, and each of its commands holds Redis (one thread)
# for every other client: a GET arriving meanwhile waits for it. Measured at 1M entries
# (INFO commandstats): SCAN COUNT 100 ~80 us, UNLINK of 100 keys ~100-150 us; of 32 keys,
# ~30 and ~40 us. So a purge takes steps of 32 keys and rests after each (at least 1 ms, and
# as long as the step took, up to 10 ms): Redis spends a few % of its time on it, and a GET
# that meets a step waits ~40 us at most. (Unpaced steps of 100 kept Redis busy most of the
# purge: another namespace's GET p99 7-14x at 1M.) 1M entries go in ~40 s.
_PURGE_STEP = 32
_PURGE_REST = 0.001  # seconds; uvloop does not sleep for less than a millisecond
_PURGE_REST_MAX = 0.01


async def purge_namespace(client: Client, namespace: str, *, pause: PurgePause | None = None
                          ) -> int:
    """SCAN "<namespace>/*" on every primary and UNLINK in small steps, resting between
    them (and awaiting `pause`, if given, after each rest); return the count."""
    removed = 0
    started = time.monotonic()
    batches = _batches(client, _glob_escape(namespace) + "/*", count=_PURGE_STEP,
                       size=_PURGE_STEP)
    batch = await anext(batches, None)
    while batch is not None:
        # On a cluster, unlink() splits the batch by slot into one pipeline.
        removed += int(await client.unlink(*batch))
        batch = await anext(batches, None)  # (the next step's SCAN: is there one?)
        if batch is not None:
            started = await _rest(started, pause)
    return removed


async def purge_on_lane(lane: GetLane, namespace: str, *, pause: PurgePause | None = None
                        ) -> int:
    """purge_namespace on one server, through a lane of the purge's own (resp.py): one
    SCAN and one UNLINK per step, packed and parsed at a fraction of redis-py's CPU, which
    in the serving process is event-loop time every GET waits behind."""
    pattern = (_glob_escape(namespace) + "/*").encode()
    count = str(_PURGE_STEP).encode()
    removed, cursor = 0, b"0"
    started = time.monotonic()
    while True:
        reply = await lane.call(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", count)
        cursor, keys = cast(list[Any], reply)
        if keys:
            removed += int(cast(int, await lane.call(b"UNLINK", *keys)))
        if cursor == b"0":
            return removed
        started = await _rest(started, pause)


async def _rest(step_started: float, pause: PurgePause | None) -> float:
    """Sleep after a purge step (at least _PURGE_REST, and as long as the step took, up to
    _PURGE_REST_MAX: a busy server slows the purge down), then await the pause if any; the
    time the next step starts."""
    took = time.monotonic() - step_started
    await asyncio.sleep(min(_PURGE_REST_MAX, max(_PURGE_REST, took)))
    if pause is not None:
        await pause()
    return time.monotonic()


async def scan_page(client: Client, prefix: str, *, cursor: str,
                    limit: int) -> tuple[list[str], str]:
    """One page of the keys starting with prefix, from a SCAN cursor: O(page), where sorting
    the prefix for every page cost the whole prefix each time. A cluster's cursor names the
    primary it is on ("host:port/position"); the primaries are visited in name order."""
    pattern = _glob_escape(prefix) + "*"
    if isinstance(client, RedisCluster):
        return await _cluster_page(client, pattern, cursor, limit)
    keys: list[bytes | str] = []
    position = int(cursor or 0)
    for _ in range(_PAGE_SCANS):
        position, batch = await client.scan(position, match=pattern, count=limit)
        keys += batch
        if position == 0 or len(keys) >= limit:
            break
    return _decoded(keys), str(position) if position else ""


async def _cluster_page(client: RedisCluster, pattern: str, cursor: str,
                        limit: int) -> tuple[list[str], str]:
    primaries = sorted(client.get_primaries(), key=lambda node: node.name)
    names = [node.name for node in primaries]
    name, _, at = cursor.rpartition("/")
    if cursor and name not in names:
        raise BackendError(f"the cluster's primaries changed while listing ({name} is gone)")
    index, position = (names.index(name), int(at)) if cursor else (0, 0)
    keys: list[bytes | str] = []
    for _ in range(_PAGE_SCANS):
        reply = await client.scan(position, match=pattern, count=limit,
                                  target_nodes=primaries[index])
        positions, batch = cast(tuple[dict[str, int], list[bytes | str]], reply)  # per node
        keys += batch
        position = int(positions[names[index]])
        index += position == 0
        if index == len(names) or len(keys) >= limit:
            break
    return _decoded(keys), f"{names[index]}/{position}" if index < len(names) else ""


def random_cursor(client: Client, rng: random.Random) -> str:
    """A SCAN cursor at a random point: the server masks any number to a position in its
    hash table (SCAN's guarantees hold from cursor 0 only: good enough for a sample)."""
    position = rng.getrandbits(48)
    if not isinstance(client, RedisCluster):
        return str(position)
    names = sorted(node.name for node in client.get_primaries())
    return f"{rng.choice(names)}/{position}"


def _decoded(keys: list[bytes | str]) -> list[str]:
    return [k.decode(errors="replace") if isinstance(k, bytes) else k for k in keys]


async def namespace_stats(client: Client, namespace: str) -> tuple[int, int]:
    """(entries, key + value bytes) of one namespace, by SCAN and pipelined STRLEN."""
    entries = total = 0
    async for batch in _batches(client, _glob_escape(namespace) + "/*"):
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.strlen(key)
        # A key that expires between SCAN and STRLEN counts with 0 value bytes.
        lengths = await pipe.execute()
        entries += len(batch)
        total += sum(len(k) for k in batch) + sum(int(n) for n in lengths)
    return entries, total


async def stats(client: Client) -> StoreStatsResult:
    """DBSIZE entries and used_memory bytes, summed over primaries; maxmemory or None."""
    sizes = await on_primaries(client, "DBSIZE")
    infos = await on_primaries(client, "INFO", "memory")
    bounds = [int(info.get("maxmemory", 0)) for info in infos]
    return StoreStatsResult(
        entries=sum(int(size) for size in sizes),
        bytes=sum(int(info["used_memory"]) for info in infos),
        max_bytes=sum(bounds) if all(bounds) else None,
    )


async def on_primaries(client: Client, *args: str) -> list[Any]:
    """One command's reply from every primary (the one server's, if not a cluster)."""
    if isinstance(client, RedisCluster):
        return [
            await client.execute_command(*args, target_nodes=node)
            for node in client.get_primaries()
        ]
    return [await client.execute_command(*args)]  # type: ignore[no-untyped-call]


async def _batches(client: Client, pattern: str, *, count: int = _SCAN_COUNT,
                   size: int = PURGE_BATCH) -> AsyncIterator[list[bytes]]:
    """Distinct-enough batches of keys matching pattern (SCAN may repeat a key)."""
    batch: list[bytes] = []
    async for key in client.scan_iter(match=pattern, count=count):
        batch.append(key)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _glob_escape(text: str) -> str:
    """text as a literal inside a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
