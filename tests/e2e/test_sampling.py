"""Sampling modes over HTTP: force-greedy rewrites, seeded caches by seed, bypass passes through."""

from __future__ import annotations

from typing import Any

import aiohttp

from policies.sampling import SamplingMode
from tests.conftest import Proxy, ProxyFactory


async def _post(proxy: Proxy, body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(resp.headers), await resp.json()


BASE = {"prompt": "The horse", "max_tokens": 24}


async def test_force_greedy_rewrites_sampling_and_shares_the_greedy_entry(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy()
    h1, greedy = await _post(proxy, {**BASE, "temperature": 0})
    h2, hot = await _post(proxy, {**BASE, "temperature": 0.9, "top_p": 0.5, "seed": 3})
    assert h1["X-Cache"] == "MISS" and "X-Cache-Sampling" not in h1
    assert h2["X-Cache"] == "HIT; reason=forced-greedy"
    assert h2["X-Cache-Sampling"] == "rewritten-to-greedy"
    assert h1["X-Cache-Key"] == h2["X-Cache-Key"]
    assert hot["choices"][0]["text"] == greedy["choices"][0]["text"]


async def test_seeded_mode_caches_by_seed_and_replays_the_same_sample(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy(sampling=SamplingMode.SEEDED)
    body = {**BASE, "temperature": 1.5, "seed": 7}
    h1, first = await _post(proxy, body)
    h2, second = await _post(proxy, body)
    assert (h1["X-Cache"], h2["X-Cache"]) == ("MISS; reason=seeded", "HIT; reason=seeded")
    assert first["choices"] == second["choices"]
    # Generated alone on the one lane, a seeded sample is reproducible: a fresh store
    # regenerates exactly the same text.
    fresh = await make_proxy(sampling=SamplingMode.SEEDED)
    h3, third = await _post(fresh, body)
    assert h3["X-Cache"] == "MISS; reason=seeded"
    assert third["choices"][0]["text"] == first["choices"][0]["text"]
    h4, _ = await _post(proxy, {**body, "seed": 8})
    assert h4["X-Cache-Key"] != h1["X-Cache-Key"]


async def test_seeded_mode_bypasses_unseeded_sampling(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(sampling=SamplingMode.SEEDED)
    before = proxy.generations
    for _ in range(2):
        h, _ = await _post(proxy, {**BASE, "temperature": 1.0})
        assert h["X-Cache"] == "BYPASS; reason=unseeded-sampling"
    assert proxy.generations == before + 2
    h, _ = await _post(proxy, {**BASE, "temperature": 0})
    assert h["X-Cache"] == "MISS"


async def test_bypass_mode_passes_sampling_through(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(sampling=SamplingMode.BYPASS)
    h, out = await _post(proxy, {**BASE, "temperature": 0.8, "seed": 1})
    assert h["X-Cache"] == "BYPASS; reason=sampling"
    assert out["choices"][0]["text"]
    assert await proxy.entries() == 0  # nothing stored for a bypass
