"""Upstream mode against real `python -m mlx_lm.server` processes serving the demo model.

Two upstreams live for the session; a test that kills one starts its own. Relays
(tests/upstreams.py) sit in between where a test must see what an upstream was sent.
"""

from __future__ import annotations

import asyncio
import gc
import re
import shutil
import subprocess
import sys
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from backends import open_backend
from backends.base import Backend
from cacheproxy.cli.serve import build_app, build_runners
from cacheproxy.cli.settings import Settings, build_settings
from cacheproxy.edge.state import INVALIDATOR, PROXY
from cacheproxy.keys.canonical import parse
from cacheproxy.runners.demo.model import write_copy
from cacheproxy.runners.pool import agree
from cacheproxy.runners.upstream import UpstreamRunner
from cacheproxy.runners.upstream_model import UpstreamOptions
from cacheproxy.runners.upstream_stream import _Reader
from cacheproxy.runners.upstream_wire import parse_system_fingerprint, rejection
from policies.sampling import SamplingMode
from tests.conftest import asker, demo_token, free_port, miss_then_hit
from tests.e2e.test_proxy import NO_EOS
from tests.e2e.test_upstream_stream import bursts, linux
from tests.harness.upstreams import Relay, Upstream

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
MODEL_ID = "demo-upstream"


def _token(marker: str) -> str:
    return str(demo_token(marker))


# Long answers of plain text: no end, no thought, no tool call (mlx_lm.server holds a call's
# tokens back until it closes, which a run-on call never does).
TEXT_ONLY = {**NO_EOS, _token("<tool_call>"): -100, _token("<think>"): -100}


def _chat(question: str, **extra: object) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": question}],
            "max_tokens": 40, **extra}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the demo model: what the upstreams serve and the proxy fingerprints."""
    return write_copy(tmp_path_factory.mktemp("upstream") / "model")


@pytest.fixture(scope="session")
def upstreams(model_dir: Path) -> Iterator[list[Upstream]]:
    """Two mlx_lm.server processes for the whole session, started side by side."""
    servers = [Upstream(model_dir, free_port(), model_dir.parent / f"server-{i}.log")
               for i in range(2)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.kill()


@dataclass
class UpProxy:
    """A cacheproxy in upstream mode on a real port."""

    url: str
    app: web.Application

    async def health(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """GET /health."""
        async with session.get(self.url + "/health") as resp:
            data: dict[str, Any] = await resp.json()
            return data


@pytest_asyncio.fixture
async def start_proxy(model_dir: Path, tmp_path: Path
                      ) -> AsyncIterator[Callable[..., Awaitable[UpProxy]]]:
    """Start cacheproxy apps that build their own UpstreamRunner from Settings."""
    servers: list[TestServer] = []
    stores: list[Backend] = []

    async def start(urls: list[str], **overrides: object) -> UpProxy:
        settings = replace(Settings(store="memory://", upstream=tuple(urls),
                                    model_dir=str(model_dir), model_id=MODEL_ID, watch=False,
                                    digest_memo=str(tmp_path / "memo.json")), **overrides)
        stores.append(store := open_backend(settings.store))
        server = TestServer(build_app(settings, store=store), host="127.0.0.1",
                            port=free_port())
        await server.start_server()
        servers.append(server)
        return UpProxy(f"http://127.0.0.1:{server.port}", server.app)

    yield start
    for server in servers:
        await server.close()
    for store in stores:
        await store.aclose()


@pytest_asyncio.fixture
async def relay() -> AsyncIterator[Callable[[str], Awaitable[Relay]]]:
    """Start recording relays in front of upstreams."""
    servers: list[TestServer] = []

    async def start(target: str) -> Relay:
        relay = Relay(target)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", relay.handle)
        server = TestServer(app, host="127.0.0.1", port=free_port())
        await server.start_server()
        servers.append(server)
        relay.url = f"http://127.0.0.1:{server.port}"
        return relay

    yield start
    for server in servers:
        await server.close()


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                ) -> tuple[int, str, dict[str, Any]]:
    async with session.post(url, json=body) as resp:
        return resp.status, resp.headers.get("X-Cache", ""), await resp.json()


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                  ) -> tuple[int, str, str]:
    """Status, X-Cache and the concatenated text of a streamed completion."""
    async with session.post(url, json={**body, "stream": True}) as resp:
        text = ""
        async for line in resp.content:
            if line.startswith(b"data: {"):
                for choice in orjson.loads(line[6:]).get("choices", []):
                    text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        return resp.status, resp.headers.get("X-Cache", ""), text


def _content(data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


async def _direct(session: aiohttp.ClientSession, upstream: str, body: dict[str, Any],
                  path: str = CHAT) -> str:
    """The same request straight to the upstream, seeded and greedy like the proxy sends it."""
    direct = {**body, "model": "default_model", "temperature": 0, "seed": 0}
    status, _, data = await _post(session, upstream + path, direct)
    assert status == 200, data
    return _content(data)


async def test_miss_then_hit_is_what_the_upstream_answers(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    proxy = await start_proxy([upstreams[0].url])
    async with aiohttp.ClientSession() as session:
        body = _chat("What does the fox eat?")
        expected = await _direct(session, upstreams[0].url, body)
        assert expected
        for wanted in ("MISS", "HIT"):
            status, cache, data = await _post(session, proxy.url + CHAT, body)
            assert (status, cache, _content(data)) == (200, wanted, expected)
            assert data["usage"]["completion_tokens"] > 0
        streamed = _chat("Where does the duck live?")
        expected = await _direct(session, upstreams[0].url, streamed)
        for wanted in ("MISS", "HIT"):
            assert await _stream(session, proxy.url + CHAT, streamed) == (200, wanted, expected)
        text = {"model": MODEL_ID, "prompt": "The owl", "max_tokens": 30}
        expected = await _direct(session, upstreams[0].url, text, TEXT)
        for wanted in ("MISS", "HIT"):
            assert await _stream(session, proxy.url + TEXT, text) == (200, wanted, expected)


async def test_upstream_is_sent_every_parameter_greedy_and_seeded(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]],
    relay: Callable[[str], Awaitable[Relay]],
) -> None:
    recorder = await relay(upstreams[0].url)
    proxy = await start_proxy([recorder.url], sampling=SamplingMode.SEEDED)
    async with aiohttp.ClientSession() as session:
        await _post(session, proxy.url + CHAT, _chat("What does the cow say?", top_p=0.5))
        await _post(session, proxy.url + CHAT,
                    _chat("What does the cat say?", temperature=0.8, seed=7, top_k=5))
        # Unseeded sampling is a BYPASS the client wants random: no seed is pinned on it.
        await _post(session, proxy.url + CHAT, _chat("What does the pig say?", temperature=0.8))
    greedy, seeded, unseeded = recorder.generations
    assert "seed" not in unseeded and unseeded["temperature"] == 0.8
    assert greedy == {
        "model": "default_model", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "What does the cow say?"}],
        "max_tokens": 40, "temperature": 0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
        "seed": 0, "repetition_penalty": 1.0, "repetition_context_size": 20,
        "presence_penalty": 0.0, "presence_context_size": 20, "frequency_penalty": 0.0,
        "frequency_context_size": 20, "xtc_probability": 0.0, "xtc_threshold": 0.0,
        "logit_bias": {}, "logprobs": False, "top_logprobs": 0, "stop": [],
        "chat_template_kwargs": {"enable_thinking": True},  # the default, made explicit
    }
    assert (seeded["temperature"], seeded["seed"], seeded["top_k"]) == (0.8, 7, 5)


async def test_stop_strings_cut_the_openai_way(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    proxy = await start_proxy([upstreams[0].url])
    async with aiohttp.ClientSession() as session:
        full = await _direct(session, upstreams[0].url, _chat("What does the fox eat?"))
        word = full.split()[2]  # a word inside the answer, after a space
        body = _chat("What does the fox eat?", stop=[word])
        # mlx_lm.server matches `word` as tokens (no leading space: no match), strips its
        # text and goes on; OpenAI semantics end the answer just before it.
        assert await _direct(session, upstreams[0].url, body) != full[: full.index(word)]
        for wanted in ("MISS", "HIT"):
            status, cache, data = await _post(session, proxy.url + CHAT, body)
            assert (status, cache) == (200, wanted)
            assert _content(data) == full[: full.index(word)]
            assert data["choices"][0]["finish_reason"] == "stop"
            assert data["usage"]["prompt_tokens"] > 0


async def test_a_stop_string_is_read_live_and_the_upstream_hung_up_on_there(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]],
    relay: Callable[[str], Awaitable[Relay]],
) -> None:
    recording = await relay(upstreams[0].url)
    proxy = await start_proxy([recording.url])
    async with aiohttp.ClientSession() as session:
        long = _chat("What does the fox eat?", max_tokens=200, logit_bias=NO_EOS)
        full = await _direct(session, upstreams[0].url, long)
        word = full.split()[2]
        status, cache, data = await _post(session, proxy.url + CHAT, {**long, "stop": [word]})
        assert (status, cache, _content(data)) == (200, "MISS", full[: full.index(word)])
        for _ in range(100):
            if recording.relayed:
                break
            await asyncio.sleep(0.05)
    # Gathered, all 200 events would have been read before the cut was seen.
    assert len(recording.relayed) == 1 and recording.relayed[0] < 100, recording.relayed


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _calls(data: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(c["id"], c["function"]["name"], orjson.loads(c["function"]["arguments"]))
            for c in data["choices"][0]["message"].get("tool_calls") or []]


async def _stream_calls(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                        ) -> tuple[str, list[tuple[str, str, dict[str, Any]]]]:
    async with session.post(url, json={**body, "stream": True}) as resp:
        calls = []
        async for line in resp.content:
            if line.startswith(b"data: {"):
                for choice in orjson.loads(line[6:]).get("choices", []):
                    for c in (choice.get("delta") or {}).get("tool_calls") or []:
                        calls.append((c["id"], c["function"]["name"],
                                      orjson.loads(c["function"]["arguments"])))
        return resp.headers.get("X-Cache", ""), calls


async def test_tool_calls_through_mlx_lm_server_get_ids_of_their_own(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    proxy = await start_proxy([upstreams[0].url])
    # (A question the demo model answers with a well-formed call without the proxy's grammar:
    # mlx_lm.server drops a call that does not parse.)
    body = {**_chat("Weather in Lima?", max_tokens=120), "tools": [WEATHER]}
    async with aiohttp.ClientSession() as session:
        direct = [await _post(session, upstreams[0].url + CHAT,
                              {**body, "model": "default_model", "seed": 0}) for _ in range(2)]
        first = await _post(session, proxy.url + CHAT, body)
        second = await _post(session, proxy.url + CHAT, body)
        streamed = await _stream_calls(session, proxy.url + CHAT, body)
        forced = await _post(session, proxy.url + CHAT, {**body, "tool_choice": "required"})
    # mlx_lm.server names every call anew (uuid4); the proxy's ids come from the key.
    (a,), (b,) = _calls(direct[0][2]), _calls(direct[1][2])
    assert a[1:] == b[1:] and a[1] == "get_weather" and a[0] != b[0]
    assert (first[1], second[1]) == ("MISS", "HIT")
    ((call_id, name, arguments),) = _calls(first[2])
    assert (name, arguments) == a[1:]  # the upstream's call, with an id of the proxy's
    assert call_id.startswith("call_") and _calls(second[2]) == _calls(first[2])
    assert first[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert streamed == ("HIT", _calls(first[2]))
    assert forced[0] == 400 and forced[2]["error"]["code"] == "unsupported_parameter"
    assert forced[2]["error"]["param"] == "tool_choice"


def _strict(cities: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a city.", "strict": True,
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "enum": cities}}}}}


async def test_structured_requests_are_validated_and_a_violating_answer_is_never_stored(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    # (#34) mlx_lm.server ignores response_format and strict: upstream mode takes them and
    # checks the answer. The demo model calls get_weather(city="Lima") for this question.
    proxy = await start_proxy([upstreams[0].url])
    held = {**_chat("Weather in Lima?", max_tokens=120), "tools": [_strict(["Lima", "Oslo"])]}
    # Control: the same call against a schema it breaks (Lima is not in the enum).
    broken = {**held, "tools": [_strict(["Oslo", "Paris"])]}
    as_json = {**_chat("What does the fox eat?"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "Food", "schema": {
            "type": "object", "properties": {"food": {"type": "string"}},
            "required": ["food"]}}}}
    async with aiohttp.ClientSession() as session:
        ok = [await _post(session, proxy.url + CHAT, held) for _ in range(2)]
        async with session.post(proxy.url + CHAT, json=held) as resp:
            guarantee = resp.headers.get("X-Cache-Schema")
        bad = [await _post(session, proxy.url + CHAT, broken) for _ in range(2)]
        text = [await _post(session, proxy.url + CHAT, as_json) for _ in range(2)]
    assert [(status, cache) for status, cache, _ in ok] == [(200, "MISS"), (200, "HIT")]
    ((_, name, arguments),) = _calls(ok[0][2])
    assert (name, arguments, guarantee) == ("get_weather", {"city": "Lima"}, "validated")
    for status, _, data in bad + text:  # each time generated anew: nothing was stored
        assert (status, data["error"]["code"]) == (502, "schema_violated")
    assert "tool call 0 (get_weather) breaks its schema at $['city']" in \
        bad[0][2]["error"]["message"]
    assert text[0][2]["error"]["message"].startswith("the answer is not JSON")


async def test_parallel_tool_calls_false_closes_the_upstream_stream_after_one_call(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    proxy = await start_proxy([upstreams[0].url])
    body = {**_chat("Weather in Lima?", max_tokens=160),
            "tools": [WEATHER]}
    async with aiohttp.ClientSession() as session:
        both = await _post(session, proxy.url + CHAT, body)
        one = await _post(session, proxy.url + CHAT, {**body, "parallel_tool_calls": False})
    assert _calls(both[2])
    assert [c[1:] for c in _calls(one[2])] == [c[1:] for c in _calls(both[2])][:1]
    assert one[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert one[2]["usage"]["prompt_tokens"] > 0


async def test_a_call_in_the_answer_to_a_request_without_tools_stays_text(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]],
    relay: Callable[[str], Awaitable[Relay]],
) -> None:
    # mlx_lm.server parses calls whatever the request offered; a relay that offers the
    # model a tool behind the proxy's back makes it call one (a fake: the demo model calls
    # nothing it was not offered).
    tampering = await relay(upstreams[0].url)
    tampering.inject = {"tools": [WEATHER]}
    proxy = await start_proxy([tampering.url])
    body = _chat("Weather in Lima?", max_tokens=120)
    async with aiohttp.ClientSession() as session:
        status, cache, data = await _post(session, proxy.url + CHAT, body)
    message = data["choices"][0]["message"]
    assert (status, cache) == (200, "MISS") and not message.get("tool_calls")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {' in message["content"]
    assert message["content"].rstrip().endswith("</tool_call>")
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_the_responses_api_through_an_upstream_shares_the_chat_entry(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    proxy = await start_proxy([upstreams[0].url])
    async with aiohttp.ClientSession() as session:
        chat = _chat("Where does the wolf live?")
        expected = await _direct(session, upstreams[0].url, chat)
        body = {"model": MODEL_ID, "input": "Where does the wolf live?", "max_output_tokens": 40}
        first = await _post(session, proxy.url + "/v1/responses", body)
        second = await _post(session, proxy.url + CHAT, chat)
        third = await _post(session, proxy.url + "/v1/responses", body)
    assert (first[1], second[1], third[1]) == ("MISS", "HIT", "HIT")
    message = next(i for i in first[2]["output"] if i["type"] == "message")
    assert message["content"][0]["text"] == _content(second[2]) == expected
    assert third[2]["output"] == first[2]["output"]


async def test_the_messages_api_through_an_upstream_shares_the_chat_entry_and_counts_tokens(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    proxy = await start_proxy([upstreams[0].url])
    ask = [{"role": "user", "content": "Where does the bear live?"}]
    body = {"model": MODEL_ID, "messages": ask, "max_tokens": 40}
    async with aiohttp.ClientSession() as session:
        first = await _post(session, proxy.url + "/v1/messages", body)
        # (Messages' absent `thinking` is off, as in Anthropic's API: so is this twin's.)
        second = await _post(session, proxy.url + CHAT, _chat(
            "Where does the bear live?", chat_template_kwargs={"enable_thinking": False}))
        count = await _post(session, proxy.url + "/v1/messages/count_tokens",
                            {"model": MODEL_ID, "messages": ask})
    assert (first[1], second[1]) == ("MISS", "HIT")
    assert first[2]["content"][-1]["text"] == _content(second[2])
    # What mlx_lm.server reported as the prompt is what count_tokens renders from its files.
    assert count[2] == {"input_tokens": second[2]["usage"]["prompt_tokens"]}
    assert first[2]["usage"]["input_tokens"] == count[2]["input_tokens"]


async def test_pool_spreads_concurrent_misses(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]],
    relay: Callable[[str], Awaitable[Relay]],
) -> None:
    relays = [await relay(u.url) for u in upstreams]
    proxy = await start_proxy([r.url for r in relays])
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(
            _post(session, proxy.url + CHAT, _chat(f"Tell me about animal number {i}."))
            for i in range(8)))
        lane = (await proxy.health(session))["lane"]
    assert {(status, cache) for status, cache, _ in results} == {(200, "MISS")}
    counts = [len(r.generations) for r in relays]
    assert sum(counts) == 8 and min(counts) >= 2, counts
    assert [u["served"] for u in lane["upstreams"]] == counts
    assert (lane["lanes"], lane["busy"], lane["queued"]) == (2, 0, 0)


async def test_pool_excludes_an_upstream_of_another_engine(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]],
    relay: Callable[[str], Awaitable[Relay]],
) -> None:
    good, other = await relay(upstreams[0].url), await relay(upstreams[1].url)
    other.fingerprint = "0.1.0-0.1.0-Linux-fake"  # a fake: another mlx-lm/mlx, same process
    with capture_logs() as logs:
        proxy = await start_proxy([good.url, other.url])
    assert [e for e in logs if e["event"] == "upstream_excluded"][0]["upstream"] == other.url
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(_post(session, proxy.url + CHAT, _chat(f"Animal {i}?"))
                               for i in range(4)))
        lane = (await proxy.health(session))["lane"]
    assert (len(good.generations), len(other.generations)) == (4, 0)
    assert [u["state"] for u in lane["upstreams"]] == ["up", "excluded"]
    assert lane["counters"]["upstream_excluded"] == 1 and lane["lanes"] == 1


async def test_engine_change_is_served_not_stored_and_rekeys(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]],
    relay: Callable[[str], Awaitable[Relay]],
) -> None:
    upgraded = await relay(upstreams[0].url)
    proxy = await start_proxy([upgraded.url])
    old = proxy.app[PROXY].runner.fingerprint().digest
    body = _chat("What does the hen eat?")
    async with aiohttp.ClientSession() as session:
        assert (await _post(session, proxy.url + CHAT, body))[1] == "MISS"
        upgraded.fingerprint = "9.9.9-9.9.9-Linux-fake"  # the upstream "restarted upgraded"
        status, cache, data = await _post(session, proxy.url + CHAT, _chat("Who is the owl?"))
        assert (status, cache) == (200, "MISS") and data["choices"][0]["finish_reason"]
        assert proxy.app[PROXY].runner.fingerprint().engine_version == "9.9.9"
        assert proxy.app[PROXY].runner.fingerprint().digest != old
        # Answered by the new engine under the old key: not stored there, and not here.
        assert (await _post(session, proxy.url + CHAT, _chat("Who is the owl?")))[1] == "MISS"
        assert (await _post(session, proxy.url + CHAT, _chat("Who is the owl?")))[1] == "HIT"
        assert (await _post(session, proxy.url + CHAT, body))[1] == "MISS"  # old namespace
    assert proxy.app[INVALIDATOR].counters["fingerprint_changes"] == 1


async def test_killed_upstream_is_502_and_a_restart_serves_again(
    model_dir: Path, start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    upstream = Upstream(model_dir, free_port(), model_dir.parent / "server-killed.log")
    try:
        upstream.start()
        upstream.wait_ready()
        proxy = await start_proxy([upstream.url])
        async with aiohttp.ClientSession() as session:
            assert (await _post(session, proxy.url + CHAT, _chat("Hello!")))[:2] == (200, "MISS")
            upstream.kill()
            status, _, data = await _post(session, proxy.url + CHAT, _chat("Hi there!"))
            assert status == 502
            assert data["error"]["code"] == "upstream_unavailable"
            assert data["error"]["type"] == "server_error" and data["error"]["message"]
            assert (await _stream(session, proxy.url + CHAT, _chat("Hey!")))[0] == 502
            assert (await proxy.health(session))["lane"]["upstreams"][0]["state"] == "down"
            upstream.start()
            upstream.wait_ready()
            assert (await _post(session, proxy.url + CHAT, _chat("Hi there!")))[:2] == (
                200, "MISS")
            assert (await _stream(session, proxy.url + CHAT, _chat("Hey!")))[:2] == (200, "MISS")
            assert (await proxy.health(session))["lane"]["upstreams"][0]["state"] == "up"
    finally:
        upstream.kill()


async def test_leader_disconnect_mid_stream_still_stores(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    proxy = await start_proxy([upstreams[1].url])
    body = _chat("Once upon a time, the owl", max_tokens=150, logit_bias=NO_EOS, stream=True)
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + CHAT, json=body) as resp:
            assert resp.headers["X-Cache"] == "MISS"
            async for line in resp.content:
                if b'"content":"' in line and b'"content":""' not in line:
                    break  # the first token arrived: hang up
        for _ in range(400):  # the client is gone; the shared fill reads on to the end
            if (await proxy.health(session))["fills_in_progress"] == 0:
                break
            await asyncio.sleep(0.05)
        status, cache, data = await _post(session, proxy.url + CHAT, {**body, "stream": False})
    assert (status, cache, data["usage"]["completion_tokens"]) == (200, "HIT", 150)


@linux
async def test_deltas_are_gathered_while_nobody_streams_them(
    upstreams: list[Upstream], model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = [0]
    data_received = _Reader.data_received

    def counted(reader: _Reader, data: bytes) -> None:  # the real reader, its reads counted
        reads[0] += b"data: " in data  # not the head, nor prefill's keepalive comments
        data_received(reader, data)

    monkeypatch.setattr(_Reader, "data_received", counted)
    runner = UpstreamRunner(UpstreamOptions(urls=(upstreams[0].url,), model_dir=model_dir,
                                            model_id=MODEL_ID, digest_memo=tmp_path / "m.json"))
    await runner.start()
    try:
        counts, texts = [], []
        for live in (False, True):
            request = parse(_chat(f"Tell me about the owl (live: {live}).", max_tokens=120,
                                  logit_bias=TEXT_ONLY), "chat", runner.defaults(),
                            SamplingMode.FORCE_GREEDY).request
            generation, chunks, reads[0] = runner.generate(request), [], 0
            if live:
                generation.live.start()
            output = await generation.relay(chunks.append)
            counts.append(reads[0])
            texts.append(output.text)
            assert len(chunks) > 60  # a token a chunk (but markup tokens: none)
            gone = weakref.ref(generation)
            await asyncio.sleep(0.01)  # the runner's task ends
            gc.disable()
            try:  # a finished reading holds nothing in a cycle: freed without the collector
                del generation
                assert gone() is None
            finally:
                gc.enable()
    finally:
        await runner.aclose()
    # Gathered: the first delta (it shows the engine), then the rest at the close (120
    # events are about 40 KB, under the 64 KiB a wake-up gathers). Live: as they arrive,
    # one by one on an idle machine (~120 reads); on a busy one the kernel hands several
    # events over in one read (46 seen in CI with two workers), so the bound is the shape,
    # not the count: an order of magnitude more reads than gathered.
    assert counts[0] <= 3 and counts[1] >= 30, counts
    assert texts[0] and texts[1]


@linux
async def test_a_streaming_follower_of_a_gathered_miss_gets_the_tokens_live(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]],
    relay: Callable[[str], Awaitable[Relay]],
) -> None:
    slow = await relay(upstreams[0].url)
    slow.stall_midway = 0.1  # a known moment after the first token: the proxy gathers
    proxy = await start_proxy([slow.url])
    body = _chat("Once upon a time, the fox", max_tokens=300, logit_bias=TEXT_ONLY,
                 chat_template_kwargs={"enable_thinking": False})
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        leader = asyncio.create_task(_post(session, proxy.url + CHAT, body))
        await asyncio.wait_for(slow.midway.wait(), 30)
        await asyncio.sleep(0.02)  # the first token reached the proxy
        arrivals, text = [], ""
        async with session.post(proxy.url + CHAT, json={**body, "stream": True}) as resp:
            assert resp.headers["X-Cache"] == "COALESCED"
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    delta = orjson.loads(line[6:])["choices"][0]["delta"].get("content")
                    if delta:
                        arrivals.append(loop.time())
                        text += delta
        status, cache, data = await leader
    assert (status, cache, _content(data)) == (200, "MISS", text)
    # Gathered to the end, all 300 would come in two or three reads: they came as generated
    # (those the relay held during its stall in a few bursts, the rest one by one).
    sizes = bursts(arrivals)
    assert len(sizes) >= 30, sizes


async def test_only_streaming_readers_make_a_fill_read_live(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]]
) -> None:
    proxy = await start_proxy([upstreams[0].url])
    runner = proxy.app[PROXY].runner
    generate, lives = runner.generate, []

    def spy(request: Any, **kw: Any) -> Any:  # the real runner; whether each generation is
        generation = generate(request, **kw)  # live when the upstream is asked (not known yet)
        asyncio.get_running_loop().call_soon(lambda: lives.append(generation.live.on))
        return generation

    runner.generate = spy
    async with aiohttp.ClientSession() as session:
        whole = await _post(session, proxy.url + CHAT, _chat("Whole?"))
        streamed = await _stream(session, proxy.url + CHAT, _chat("Streamed?"))
    assert (whole[0], streamed[0]) == (200, 200)
    assert lives == [False, True]


async def test_upstream_errors_map_to_http(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]],
    relay: Callable[[str], Awaitable[Relay]],
) -> None:
    # Fakes: a valid canonical request never makes mlx_lm.server refuse or stall.
    front = await relay(upstreams[0].url)
    proxy = await start_proxy([front.url], upstream_timeout=0.5)
    async with aiohttp.ClientSession() as session:
        front.reject = (400, {"error": "top_k must be at most 3"})
        status, _, data = await _post(session, proxy.url + CHAT, _chat("One?"))
        assert (status, data["error"]["message"]) == (400, "upstream: top_k must be at most 3")
        front.reject, front.stall = None, 2.0
        status, _, data = await _post(session, proxy.url + CHAT, _chat("Two?"))
        assert (status, data["error"]["code"]) == (504, "upstream_timeout")
        front.stall, front.stall_midway = 0.0, 2.0
        status, _, data = await _post(session, proxy.url + CHAT, _chat("Two and a half?"))
        assert (status, data["error"]["code"]) == (504, "upstream_timeout")
        front.stall_midway = 0.0
        status, _, data = await _post(session, proxy.url + CHAT, _chat("Three?", logprobs=True))
        assert (status, data["error"]["param"]) == (400, "logprobs")
        assert (await _post(session, proxy.url + CHAT, _chat("Two?")))[:2] == (200, "MISS")


def test_system_fingerprint_parses_into_engine_versions() -> None:
    raw = "0.32.2-0.32.4-Linux-6.1-x86_64-with-glibc2.36-x86_64"
    plain = parse_system_fingerprint(raw, device_scope=False)
    assert (plain.engine_version, plain.mlx_version, plain.device) == ("0.32.2", "0.32.4", "")
    scoped = parse_system_fingerprint(raw, device_scope=True)
    assert scoped.device == "Linux-6.1-x86_64-with-glibc2.36-x86_64"
    assert plain == parse_system_fingerprint(raw.replace("6.1", "6.2"), device_scope=False)
    odd = parse_system_fingerprint("fp_abc", device_scope=False)
    assert (odd.engine_version, odd.mlx_version) == ("fp_abc", "")


def test_pool_pins_one_engine() -> None:
    a, b = (parse_system_fingerprint(f"{v}-0.1-x", device_scope=False) for v in ("1.0", "2.0"))
    assert agree(None, [a, b]) == a  # a tie: the first upstream wins
    assert agree(None, [a, b, b]) == b
    assert agree(a, [b, a, b]) == a  # pinned while any member still runs it
    assert agree(a, [b]) == b  # the whole pool moved
    assert agree(a, []) == a


def test_upstream_status_mapping() -> None:
    assert (rejection(404, b'{"error": "no model"}').status, rejection(404, b"").code) == (
        404, "upstream_rejected")
    gone = rejection(503, b"busy")
    assert (gone.status, gone.code, gone.message) == (
        502, "upstream_unavailable", "the upstream answered 503: busy")


def test_settings_for_upstream_mode() -> None:
    env = {"CACHEPROXY_UPSTREAM": "http://a:1, http://b:2", "CACHEPROXY_MODEL_DIR": "/m"}
    settings = build_settings({}, env)
    assert settings.upstream == ("http://a:1", "http://b:2")
    assert settings.served_model_id == "/m"
    flags = {"upstream": ["http://c:3"], "model_dir": "/m"}
    assert build_settings(flags, {}).upstream == ("http://c:3",)
    with pytest.raises(ValueError, match="--model-dir"):
        build_settings({"upstream": ["http://c:3"]}, {})
    with pytest.raises(ValueError, match="not an http URL"):
        build_settings({"upstream": ["c:3"], "model_dir": "/m"}, {})


def test_settings_tie_each_upstream_pool_to_its_model_directory() -> None:
    """(#21) `--model-dir ID=DIR` repeated, each `--upstream ID=URL` in its pool."""
    flags = {"model_dir": ["demo=/m/demo", "q=/m/q"],
             "upstream": ["demo=http://a:1", "q=http://b:2", "demo=http://c:3"]}
    settings = build_settings(flags, {})
    assert [(p.model_id, p.model_dir, p.urls) for p in settings.upstream_pools] == [
        ("demo", "/m/demo", ("http://a:1", "http://c:3")), ("q", "/m/q", ("http://b:2",))]
    assert settings.served_model_id == "demo"
    env = {"CACHEPROXY_MODEL_DIR": "demo=/m/demo,q=/m/q",
           "CACHEPROXY_UPSTREAM": "demo=http://a:1,q=http://b:2"}
    assert [p.urls for p in build_settings({}, env).upstream_pools] == [
        ("http://a:1",), ("http://b:2",)]
    one = build_settings({"model_dir": ["/m"], "upstream": ["http://a:1"],
                          "model_id": "mine"}, {})
    assert [(p.model_id, p.urls) for p in one.upstream_pools] == [("mine", ("http://a:1",))]
    for bad, message in [
        ({"upstream": ["http://a:1"]}, "several --model-dir, give each upstream as ID=URL"),
        ({"upstream": ["x=http://a:1", "demo=http://a:1", "q=http://b:2"]},
         "'x=http://a:1' names no --model-dir"),
        ({"upstream": ["demo=http://a:1"]}, "--model-dir q=/m/q has no --upstream"),
        ({"upstream": ["demo=a:1", "q=http://b:2"]}, "'a:1' is not an http URL"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            build_settings({**flags, **bad}, {})
    with pytest.raises(ValueError, match="two models with one id"):
        build_settings({"model_dir": ["a=/m/1", "a=/m/2"], "upstream": ["a=http://a:1"]}, {})
    with pytest.raises(ValueError, match="--model is for the in-process runner"):
        build_settings({**flags, "model": ["x=/m/x"]}, {})
    with pytest.raises(ValueError, match="--model-id 'zzz' names none of the models served"):
        build_settings({**flags, "model_id": "zzz"}, {})
    with pytest.raises(ValueError, match="--model-id 'c' names none"):  # in-process alike
        build_settings({"model": ["a=/x", "b=/y"], "model_id": "c"}, {})
    home = build_settings({"model_dir": ["~/m"], "upstream": ["http://a:1"]}, {})
    assert str(build_runners(home)[0].model_dir) == str(Path("~/m").expanduser())


async def test_two_models_each_on_its_own_upstream_pool(
    upstreams: list[Upstream], model_dir: Path, relay: Callable[[str], Awaitable[Relay]],
    start_proxy: Callable[..., Awaitable[UpProxy]], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """(#21) Two model directories, each served by its own mlx_lm.server: requests route by
    `model` to that model's pool only, each model is MISS then HIT under its own
    fingerprint, and a change to one model's files re-fingerprints only that one."""
    base = tmp_path_factory.mktemp("pools")
    q4 = write_copy(base / "q4", quantize=4)
    served_q4 = Upstream(q4, free_port(), base / "server-q4.log")
    served_q4.start()
    try:
        served_q4.wait_ready()
        to_demo, to_q = await relay(upstreams[0].url), await relay(served_q4.url)
        watched = base / "watched-q4"  # the proxy's copy (the upstream keeps what it loaded)
        shutil.copytree(q4, watched)
        proxy = await start_proxy([], upstream=(f"demo={to_demo.url}", f"q={to_q.url}"),
                                  model_dir=f"demo={model_dir},q={watched}", model_id="",
                                  watch=True, watch_interval=0.1)
        async with aiohttp.ClientSession() as session:
            ask = asker(session, proxy.url + CHAT, _chat("What does the fox eat?"))
            first = await miss_then_hit(session, proxy.url, ask)
            assert (len(to_demo.generations), len(to_q.generations)) == (1, 1)

            config = orjson.loads((watched / "config.json").read_bytes())
            (watched / "config.json").write_bytes(orjson.dumps({**config, "note": "changed"}))

            async def states() -> dict[str, dict[str, Any]]:
                return {m["id"]: m for m in (await proxy.health(session))["models"]}

            for _ in range(200):
                if (await states())["q"]["fingerprint"] != first["q"][1]:
                    break
                await asyncio.sleep(0.05)
            now = await states()
            assert now["q"]["fingerprint"] != first["q"][1], "q was not re-fingerprinted"
            assert now["demo"]["fingerprint"] == first["demo"][1]
            assert now["demo"]["counters"]["reloads"] == 0
            assert (await ask("demo"))[0] == "HIT" and (await ask("q"))[0] == "MISS"
            assert (len(to_demo.generations), len(to_q.generations)) == (1, 2)
    finally:
        served_q4.kill()


def test_serve_without_a_reachable_upstream_exits_with_a_message(model_dir: Path,
                                                                  tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "cacheproxy", "serve", "--upstream", dead, "--model-dir",
         str(model_dir), "--store", "memory://", "--port", str(free_port()),
         "--digest-memo", str(tmp_path / "memo.json")],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert f"no upstream answered at start-up ({dead})" in done.stderr


async def test_model_dir_change_refingerprints(
    upstreams: list[Upstream], start_proxy: Callable[..., Awaitable[UpProxy]], tmp_path: Path
) -> None:
    # The proxy watches its own copy (the upstream keeps serving what it loaded: only the
    # proxy's side of a reload is under test here).
    copy = write_copy(tmp_path / "model")
    proxy = await start_proxy([upstreams[0].url], model_dir=str(copy), watch=True,
                              watch_interval=0.1)
    body = _chat("What does the goat eat?")
    async with aiohttp.ClientSession() as session:
        before = (await proxy.health(session))["fingerprint"]
        assert (await _post(session, proxy.url + CHAT, body))[1] == "MISS"
        config = orjson.loads((copy / "config.json").read_bytes())
        (copy / "config.json").write_bytes(orjson.dumps({**config, "note": "requantized"}))
        for _ in range(100):
            if (await proxy.health(session))["fingerprint"] != before:
                break
            await asyncio.sleep(0.05)
        assert (await proxy.health(session))["fingerprint"] != before
        assert (await _post(session, proxy.url + CHAT, body))[1] == "MISS"
    assert proxy.app[INVALIDATOR].counters["reloads"] == 1


async def test_compare_replays_stored_entries_on_an_upstream(
    upstreams: list[Upstream], model_dir: Path, make_proxy: Any, tmp_path: Path
) -> None:
    """`cacheproxy compare --to URL` (#33): entries the in-process runner stored, replayed on
    a real mlx_lm.server serving the same files. Its answers carry no token ids: the report
    says so, and compares text, calls and meaning."""
    from tests.harness.cli import cacheproxy_blocking

    store = f"disk://{tmp_path}/store"
    proxy = await make_proxy(store=store)
    bodies = [{"messages": [{"role": "user", "content": q}], "max_tokens": 40}
              for q in ("Tell me about the cat.", "What does the owl eat?")]
    bodies.append({"messages": [{"role": "user", "content": "What is the weather in Lima?"}],
                   "max_tokens": 60, "tools": [{"type": "function", "function": {
                       "name": "get_weather", "parameters": {
                           "type": "object", "properties": {"city": {"type": "string"}}}}}]})
    bodies.append({"messages": [{"role": "user", "content": "What does the fox eat?"}],
                   "max_tokens": 40, "response_format": {"type": "json_object"}})
    keys = []
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            async with session.post(proxy.url + CHAT, json=body) as resp:
                assert resp.status == 200 and resp.headers["X-Cache"] == "MISS"
                keys.append(resp.headers["X-Cache-Key"])
    done = cacheproxy_blocking("compare", "--store", store, "--to", upstreams[0].url,
                               "--to-model-dir", str(model_dir), "--json")
    assert done.returncode == 0, done.stderr
    report = orjson.loads(done.stdout)  # stdout holds the report only (logs: stderr)
    assert "token ids" not in report["checks"] and "text" in report["checks"]
    assert any(u.startswith("token ids") for u in report["unchecked"])
    assert report["fingerprints"]["differ"]["engine"] == {"stored": "mlx-lm",
                                                           "candidate": "mlx_lm.server"}
    entries = {e["key"]: e for e in report["entries"]}
    # The same files and runtime, one request at a time: the same answers, by text and call.
    for key in keys[:3]:
        assert entries[key]["exact"] and entries[key]["first_divergence"] is None, key
    assert entries[keys[2]]["compared_by"] == "tool_calls"
    # The JSON answer is not replayed: mlx_lm.server would ignore the format.
    json_entry = entries[keys[3]]
    assert json_entry["difference"].startswith("not replayed: the candidate cannot constrain")
    assert not json_entry["exact"] and not json_entry["parsed_equal"]
    assert report["exact_match_rate"] == report["parsed_match_rate"] == 0.75
