"""End to end through real HTTP and the real openai SDK: MISS, HIT, single-flight, disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai

from cacheproxy.runners.demo.model import BUNDLED_MODEL
from tests.conftest import ProxyFactory

STORY = "Once upon a time, the owl"
# Suppress the demo model's end tokens so a generation runs to max_tokens (long enough
# to watch it stream); the bias is part of the request, so it is part of the key.
_EOS = json.loads((BUNDLED_MODEL / "config.json").read_text())["eos_token_id"]
NO_EOS = {str(t): -100 for t in _EOS}


async def _chat(client: openai.AsyncOpenAI, content: str, **kw: object
                ) -> tuple[str, dict[str, str]]:
    raw = await client.chat.completions.with_raw_response.create(
        model="cacheproxy-demo", messages=[{"role": "user", "content": content}], **kw)
    completion = raw.parse()
    return completion.model_dump_json(include={"choices"}), dict(raw.headers)


async def _chat_stream(client: openai.AsyncOpenAI, content: str, **kw: object
                       ) -> tuple[list[str], dict[str, str]]:
    raw = await client.chat.completions.with_raw_response.create(
        model="cacheproxy-demo", messages=[{"role": "user", "content": content}],
        stream=True, **kw)
    pieces = [c.choices[0].delta.content async for c in raw.parse()
              if c.choices and c.choices[0].delta.content]
    return pieces, dict(raw.headers)


async def test_chat_miss_then_hit_byte_identical(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    before = proxy.generations
    first, h1 = await _chat(proxy.client, "What does the fox eat?")
    second, h2 = await _chat(proxy.client, "What does the fox eat?")
    assert h1["x-cache"] == "MISS" and h2["x-cache"] == "HIT"
    assert first == second and '"content":"' in first
    assert proxy.generations == before + 1
    assert h1["x-cache-key"] == h2["x-cache-key"]
    assert h1["x-cache-fingerprint"] == h2["x-cache-fingerprint"]
    assert "age" in h2 and "age" not in h1


async def test_hit_usage_reports_stored_counts_and_cached_prompt(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    miss = await proxy.client.chat.completions.create(
        model="cacheproxy-demo", messages=[{"role": "user", "content": "Hello!"}])
    hit = await proxy.client.chat.completions.create(
        model="cacheproxy-demo", messages=[{"role": "user", "content": "Hello!"}])
    assert miss.usage and hit.usage
    assert (hit.usage.prompt_tokens, hit.usage.completion_tokens) == (
        miss.usage.prompt_tokens, miss.usage.completion_tokens)
    assert miss.usage.completion_tokens > 0
    assert hit.usage.prompt_tokens_details and miss.usage.prompt_tokens_details
    assert hit.usage.prompt_tokens_details.cached_tokens == hit.usage.prompt_tokens
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.system_fingerprint == miss.system_fingerprint != ""
    assert hit.choices[0].message.content == miss.choices[0].message.content != ""


async def test_chat_stream_miss_then_hit_same_chunks(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    live, h1 = await _chat_stream(proxy.client, "Tell me about the owl.")
    replay, h2 = await _chat_stream(proxy.client, "Tell me about the owl.")
    assert (h1["x-cache"], h2["x-cache"]) == ("MISS", "HIT")
    assert len(live) > 3
    assert replay == live  # same text in the same chunk boundaries
    whole = await proxy.client.chat.completions.create(
        model="cacheproxy-demo", messages=[{"role": "user", "content": "Tell me about the owl."}])
    assert whole.choices[0].message.content == "".join(live)


async def test_completions_stream_and_whole_share_one_entry(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    before = proxy.generations
    raw = await proxy.client.completions.with_raw_response.create(
        model="cacheproxy-demo", prompt=STORY, max_tokens=24, stream=True,
        stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    async for chunk in raw.parse():
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert raw.headers["x-cache"] == "MISS"
    assert usage is not None and 0 < usage.completion_tokens <= 24
    raw2 = await proxy.client.completions.with_raw_response.create(
        model="cacheproxy-demo", prompt=STORY, max_tokens=24)
    whole = raw2.parse()
    assert raw2.headers["x-cache"] == "HIT"
    assert whole.choices[0].text == "".join(pieces) != ""
    assert whole.choices[0].finish_reason == finish and finish in ("stop", "length")
    assert whole.usage and whole.usage.completion_tokens == usage.completion_tokens
    raw3 = await proxy.client.completions.with_raw_response.create(
        model="cacheproxy-demo", prompt=STORY, max_tokens=24)
    assert raw3.parse().choices[0].text == whole.choices[0].text
    assert proxy.generations == before + 1


async def test_concurrent_identical_requests_generate_once(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    before = proxy.generations
    body = {"model": "cacheproxy-demo", "prompt": STORY, "max_tokens": 300, "stream": True,
            "logit_bias": NO_EOS}
    arrivals: list[list[float]] = [[] for _ in range(32)]

    async def one(i: int, session: aiohttp.ClientSession) -> tuple[str, str]:
        async with session.post(proxy.url + "/v1/completions", json=body) as resp:
            status = resp.headers["X-Cache"]
            text = []
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    arrivals[i].append(time.monotonic())
                    text.append(line)
            return status, "".join(_texts(text))

    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(one(i, session) for i in range(32)))
    assert proxy.generations == before + 1
    statuses = sorted(s for s, _ in results)
    assert statuses.count("MISS") == 1 and statuses.count("COALESCED") == 31
    texts = {t for _, t in results}
    assert len(texts) == 1 and len(next(iter(texts))) > 100
    # Followers get tokens live: each one's first token arrived before the generation ended
    # (the last token anyone received), not in a burst after it.
    generation_end = max(a[-1] for a in arrivals)
    generation_start = min(a[0] for a in arrivals)
    assert generation_end - generation_start > 0.2, "generation too short to tell live from replay"
    live = [a[0] < generation_end - 0.1 for a in arrivals]
    assert all(live), f"{live.count(False)} followers only got tokens after the end"


def _texts(lines: list[bytes]) -> list[str]:
    import orjson

    out = []
    for line in lines:
        event = orjson.loads(line[len(b"data: "):])
        out.extend(c.get("text", "") for c in event["choices"])
    return out


async def test_disconnect_mid_stream_still_stores(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    body = {"model": "cacheproxy-demo", "prompt": "One day the wolf", "max_tokens": 300,
            "stream": True, "logit_bias": NO_EOS}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.headers["X-Cache"] == "MISS"
            await resp.content.readline()  # the first event, then hang up
        # The client is gone; the shared fill must finish and be stored.
        for _ in range(200):
            async with session.get(proxy.url + "/health") as h:
                if (await h.json())["fills_in_progress"] == 0:
                    break
            await asyncio.sleep(0.05)
        body["stream"] = False
        async with session.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.headers["X-Cache"] == "HIT"
            data = await resp.json()
    assert data["choices"][0]["finish_reason"] in ("length", "stop")
    assert data["usage"]["completion_tokens"] > 10


async def test_n_greedy_choices_are_identical(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    out = await proxy.client.chat.completions.create(
        model="cacheproxy-demo", n=3, messages=[{"role": "user", "content": "Hi!"}])
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1


async def test_models_and_health(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    models = await proxy.client.models.list()
    assert [m.id for m in models.data] == ["cacheproxy-demo"]
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/health") as r:
        health = await r.json()
    assert r.status == 200 and health["status"] == "ok" and len(health["fingerprint"]) == 32


async def test_a_request_without_model_is_the_served_models_and_shares_its_entry(
        make_proxy: ProxyFactory) -> None:
    """`model` is optional, as with mlx_lm.server: the served model answers, under the key of
    the request that names it (control: a model not served is a 404)."""
    proxy = await make_proxy()
    body = {"messages": [{"role": "user", "content": "Who sleeps in the barn?"}],
            "max_tokens": 8}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=body) as unnamed:
            first = (unnamed.status, unnamed.headers["X-Cache"], unnamed.headers["X-Cache-Key"],
                     (await unnamed.json())["model"])
        named_body = {**body, "model": "cacheproxy-demo"}
        async with session.post(proxy.url + "/v1/chat/completions", json=named_body) as named:
            second = (named.status, named.headers["X-Cache"], named.headers["X-Cache-Key"])
        other = {**body, "model": "not-served"}
        async with session.post(proxy.url + "/v1/chat/completions", json=other) as refused:
            error = (refused.status, (await refused.json())["error"]["code"])
    assert first[:2] == (200, "MISS") and first[3] == "cacheproxy-demo"
    assert second == (200, "HIT", first[2])
    assert error == (404, "model_not_found")
