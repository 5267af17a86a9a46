"""Several proxy processes on one Redis: one generation per key across the fleet."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import pytest

from tests.e2e.test_proxy import NO_EOS
from tests.harness.processes import replicas
from tests.harness.redis_fixtures import StartServer


async def _generations(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/status.json") as resp:
        return int((await resp.json())["generations"])


async def test_two_replicas_generate_once_for_32_concurrent_requests(
    start_redis: StartServer,
) -> None:
    redis = start_redis()
    body = {"prompt": "Once upon a time, the bear", "max_tokens": 120, "logit_bias": NO_EOS}
    with replicas(redis.url, 2) as procs:
        urls = [replica.url for replica in procs]
        async with aiohttp.ClientSession() as session:
            async def one(i: int) -> tuple[str, str]:
                async with session.post(urls[i % 2] + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return resp.headers["X-Cache"], (await resp.json())["choices"][0]["text"]

            results = await asyncio.gather(*(one(i) for i in range(32)))
            total = sum([await _generations(session, url) for url in urls])
    assert total == 1, f"{total} generations across the fleet"
    assert len({text for _, text in results}) == 1
    statuses = [s for s, _ in results]
    assert statuses.count("MISS") == 1 and statuses.count("COALESCED") == 31


async def test_owner_killed_mid_generation_another_replica_takes_over(
    start_redis: StartServer,
) -> None:
    redis = start_redis()
    body = {"prompt": "The wolf", "max_tokens": 400, "logit_bias": NO_EOS}
    with replicas(redis.url, 2, "--lock-ttl", "1") as procs:
        owner, other_url = procs[0], procs[1].url
        owner_url = owner.url
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(session.post(owner_url + "/v1/completions", json=body))
            for _ in range(2000):  # until the owner holds the lease and generates
                if await _generations(session, owner_url) >= 1:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the owner did not start generating within ~20 s")
            second = asyncio.create_task(session.post(other_url + "/v1/completions", json=body))
            await asyncio.sleep(0.2)
            os.kill(owner.pid, signal.SIGKILL)
            resp = await second
            assert resp.status == 200
            data = await resp.json()
            assert data["usage"]["completion_tokens"] == 400
            assert await _generations(session, other_url) == 1  # it took over
            async with session.post(other_url + "/v1/completions", json=body) as again:
                assert again.headers["X-Cache"] == "HIT"  # and stored it
            with contextlib.suppress(aiohttp.ClientError):  # the owner's client lost it too
                (await first).release()


async def test_redis_stopped_and_restarted_under_requests(start_redis: StartServer) -> None:
    redis = start_redis()
    prompts = [{"prompt": f"The owl {i}", "max_tokens": 8} for i in range(3)]
    with replicas(redis.url, 1, "--store-retry", "0.3") as procs:
        url = procs[0].url
        failed = 0
        statuses: list[str] = []
        async with aiohttp.ClientSession() as session:
            async def ask(body: dict[str, object]) -> None:
                nonlocal failed
                async with session.post(url + "/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        failed += 1
                    statuses.append(resp.headers.get("X-Cache", ""))

            for body in prompts:
                await ask(body)
            redis.stop()
            for body in prompts * 3:
                await ask(body)
            assert statuses[-1] == "BYPASS; reason=store-unavailable"
            redis.start()
            await asyncio.sleep(0.5)
            for body in prompts:  # the restarted server is empty: fills, then hits
                await ask(body)
            for body in prompts:
                await ask(body)
    assert failed == 0
    assert statuses[-3:] == ["HIT"] * 3


async def test_a_purge_on_one_replica_reaches_the_others_l1(
    start_redis: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = start_redis()
    monkeypatch.setenv("CACHEPROXY_ADMIN_TOKEN", "s3cret")
    admin = {"Authorization": "Bearer s3cret"}
    body = {"prompt": "The heron", "max_tokens": 8}
    # l1_ttl of an hour: only the server's invalidations can make the other L1 let go.
    with replicas(f"tiered+{redis.url}/0?l1_ttl=3600", 2) as procs:
        one, other = procs[0].url, procs[1].url
        async with aiohttp.ClientSession() as session:
            async def ask(url: str) -> tuple[str, str]:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return resp.headers["X-Cache"], resp.headers["X-Cache-Key"]

            assert (await ask(one))[0] == "MISS"
            assert [(await ask(other))[0] for _ in range(3)] == ["HIT"] * 3  # L2, then L1
            async with session.get(f"{other}/admin/stats", headers=admin) as resp:
                assert (await resp.json())["store"]["l1"] == "tracked"
            key = (await ask(other))[1]
            async with session.delete(f"{one}/admin/entries/{key}", headers=admin) as resp:
                assert resp.status == 200
            deadline = time.monotonic() + 2
            while (status := (await ask(other))[0]) == "HIT":
                assert time.monotonic() < deadline, "the other replica kept serving it"
                await asyncio.sleep(0.01)
            assert status == "MISS"  # generated anew, as the purge asked
            async with session.get(f"{other}/metrics", headers=admin) as resp:
                metrics = await resp.text()
            assert "cacheproxy_store_l1_tracked 1.0" in metrics
            assert "cacheproxy_store_l1_invalidations 0.0" not in metrics
            assert "cacheproxy_store_l1_tracking_restarts 1.0" in metrics
            assert (await ask(one))[0] == "HIT"  # and stored for the whole fleet again
            namespace = key.partition("/")[0]
            async with session.post(f"{other}/admin/purge", json={"namespace": namespace},
                                    headers=admin) as resp:
                assert (await resp.json())["removed"] == 1
            deadline = time.monotonic() + 2
            while (status := (await ask(one))[0]) == "HIT":
                assert time.monotonic() < deadline, "the first replica kept serving it"
                await asyncio.sleep(0.01)
            assert status == "MISS"
