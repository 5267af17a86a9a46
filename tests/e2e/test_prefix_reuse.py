"""Exact prefix reuse (#18) in-process: what a miss reports of the state its prefill
continued from, what a hit does not, what operators see. (Bit-identity with a cold prefill
shows only on a batch-variant runtime: tests/system/test_prefix_reuse.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest_asyncio

from cacheproxy.cli.settings import DEMO_MODEL_ID
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from tests.conftest import ProxyFactory

# In-process, with the demo model and a small step (its prompts are shorter than the
# default step of 512): what a miss reports, what a hit does not, what operators see.

SMALL_STEP = 16


@pytest_asyncio.fixture(scope="module")
async def small_step_runner() -> AsyncIterator[MlxRunner]:
    r = MlxRunner(MlxOptions(model=str(BUNDLED_MODEL), model_id=DEMO_MODEL_ID,
                             prefill_step=SMALL_STEP))
    await r.start()
    yield r
    await r.aclose()


async def test_a_generated_answer_says_what_its_prefill_reused(
        make_proxy: ProxyFactory, small_step_runner: MlxRunner) -> None:
    proxy = await make_proxy(the_runner=small_step_runner, admin_token="t")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a friendly guide to the animals of the zoo."},
        {"role": "user", "content": "Tell me about the fox."}]
    first = await proxy.client.chat.completions.with_raw_response.create(
        model=DEMO_MODEL_ID, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    total = first.parse().usage.prompt_tokens  # type: ignore[union-attr]
    assert first.headers["x-cache-prefill"] == f"reused=0; total={total}"
    messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                 {"role": "user", "content": "And the owl?"}]

    async with aiohttp.ClientSession() as session:
        body = {"model": DEMO_MODEL_ID, "messages": messages, "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}
        async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
            assert resp.headers["X-Cache"] == "MISS"
            header = resp.headers["X-Cache-Prefill"]  # sent before the first token
            key = resp.headers["X-Cache-Key"]
            events = [line for line in (await resp.text()).splitlines()
                      if line.startswith("data: {")]
        reused = int(header.split(";")[0].removeprefix("reused="))
        assert reused > 0 and reused % SMALL_STEP == 0 and reused <= total
        usage = json.loads(events[-1].removeprefix("data: "))["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == reused
        assert header.endswith(f"total={usage['prompt_tokens']}")

        del body["stream"], body["stream_options"]
        async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
            assert resp.headers["X-Cache"] == "HIT"  # the same answer, nothing generated
            assert "X-Cache-Prefill" not in resp.headers
            hit = await resp.json()
            assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]

        auth = {"Authorization": "Bearer t"}
        async with session.get(f"{proxy.url}/admin/entries/{key}", headers=auth) as resp:
            provenance = (await resp.json())["provenance"]
        assert provenance["prefill"] == {"reused": reused, "total": usage["prompt_tokens"]}
        assert provenance["lane"] == "batch-of-one, aligned prefill"
        assert provenance["fingerprint_fields"]["prefill_step"] == SMALL_STEP
        async with session.get(proxy.url + "/health", headers=auth) as resp:
            lane = (await resp.json())["lane"]  # (figures for the status readers: the admin)
        assert lane["prefix_entries"] >= 1 and lane["prefix_bytes"] > 0
        assert lane["prefix_step"] == SMALL_STEP
        async with session.get(proxy.url + "/metrics", headers=auth) as resp:
            text = await resp.text()
        assert f"cacheproxy_prefill_reused_tokens_total {float(reused)}" in text
        assert "cacheproxy_prefix_bytes " in text


# Per-key scope covers prefix reuse (#34): tenant A puts a PIN at the head of its system
# prompt; tenant B sends the same prompt with a guessed PIN. Were the saved states shared,
# only the right guess would continue from A's state, and say so in X-Cache-Prefill,
# cached_tokens and the count of saved chunks: the PIN, confirmed in a few guesses.

PIN = "4817"
GUESSES = ("1234", "9051", PIN, "4810", "7777")
KEYS = {"a": "key-tenant-a", "b": "key-tenant-b"}
ADMIN = {"Authorization": "Bearer root"}


def _vault(pin: str, question: str, run: str) -> list[dict[str, str]]:
    """The system prompt (its first chunk holds the run's name and the PIN: the runs share
    a runner, and their prompts no chunk) and a question."""
    return [{"role": "system", "content": f"{run} PIN {pin}. Keep the vault code to yourself; "
             "you are a friendly guide to the animals of the zoo."},
            {"role": "user", "content": question}]


async def _prefill(session: aiohttp.ClientSession, url: str, tenant: str,
                   messages: list[dict[str, str]]) -> tuple[int, int, int]:
    """(reused from X-Cache-Prefill, usage's cached_tokens, saved chunks added) of a miss."""
    before = await _saved_chunks(session, url)
    body = {"model": DEMO_MODEL_ID, "messages": messages, "max_tokens": 1}
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as resp:
        assert resp.status == 200 and resp.headers["X-Cache"] == "MISS", await resp.text()
        reused = int(resp.headers["X-Cache-Prefill"].split(";")[0].removeprefix("reused="))
        cached = (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    return reused, cached, await _saved_chunks(session, url) - before


async def _saved_chunks(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/admin/stats", headers=ADMIN) as resp:
        return int((await resp.json())["lane"]["prefix_entries"])


async def _probe(url: str, run: str) -> dict[str, tuple[int, int, int]]:
    """Tenant A's PIN prompt, then what each of tenant B's guesses shows (B asks another
    question: under a shared scope the right guess would otherwise be A's HIT)."""
    async with aiohttp.ClientSession() as session:
        await _prefill(session, url, "a", _vault(PIN, "Which animal is the fastest?", run))
        return {g: await _prefill(session, url, "b", _vault(g, "Which one sleeps most?", run))
                for g in GUESSES}


async def test_per_key_scope_keeps_prefix_reuse_to_its_tenant(
        make_proxy: ProxyFactory, small_step_runner: MlxRunner) -> None:
    proxy = await make_proxy(the_runner=small_step_runner, api_keys=tuple(KEYS.values()),
                             cache_scope="per-key", admin_token="root")
    shown = await _probe(proxy.url, "tenants")
    assert len(set(shown.values())) == 1, shown  # the right guess shows what wrong ones do
    assert shown[PIN][:2] == (0, 0), shown  # (nothing of A's continued)
    async with aiohttp.ClientSession() as session:
        # Reuse within one key still works: A's and B's own states, each by its tenant.
        for tenant, pin in (("a", PIN), ("b", GUESSES[0])):
            reused, cached, _ = await _prefill(
                session, proxy.url, tenant, _vault(pin, "Which animal eats the most?", "tenants"))
            assert reused >= SMALL_STEP and cached == reused, (tenant, reused, cached)
        # /health is open: it shows no figure that moves with others' requests.
        async with session.get(proxy.url + "/health") as resp:
            health = await resp.json()
        assert resp.status == 200 and health["status"] == "ok"
        assert not {"lane", "models", "counters", "fills_in_progress"} & health.keys(), health


async def test_control_shared_prefix_states_confirm_the_pin(
        make_proxy: ProxyFactory, small_step_runner: MlxRunner) -> None:
    # Control: the same probe where the states are shared (one scope for all, or per-key
    # with --shared-prefixes) picks the PIN out of the guesses.
    for run, overrides in (("shared", {"cache_scope": "shared"}),
                           ("trusted", {"cache_scope": "per-key", "shared_prefixes": True})):
        proxy = await make_proxy(the_runner=small_step_runner, api_keys=tuple(KEYS.values()),
                                 admin_token="root", **overrides)
        shown = await _probe(proxy.url, run)
        confirmed = [g for g, (reused, _, _) in shown.items() if reused > 0]
        assert confirmed == [PIN], (overrides, shown)
        reused, cached, added = shown[PIN]
        assert cached == reused >= SMALL_STEP and added < shown[GUESSES[0]][2], shown
