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
        async with session.get(proxy.url + "/health") as resp:
            lane = (await resp.json())["lane"]
        assert lane["prefix_entries"] >= 1 and lane["prefix_bytes"] > 0
        assert lane["prefix_step"] == SMALL_STEP
        async with session.get(proxy.url + "/metrics", headers=auth) as resp:
            text = await resp.text()
        assert f"cacheproxy_prefill_reused_tokens_total {float(reused)}" in text
        assert "cacheproxy_prefix_bytes " in text
