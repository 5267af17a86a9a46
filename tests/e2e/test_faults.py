"""Faults: corrupt records, a full queue, a generation timeout, invalid UTF-8 from the model."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from backends.base import BackendError
from cacheproxy.cli.serve import build_app
from cacheproxy.cli.settings import Settings
from cacheproxy.edge.state import PROXY
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from tests.conftest import ProxyFactory, demo_token, free_port
from tests.e2e.test_proxy import NO_EOS

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "Where does the duck live?"}]}


async def test_corrupt_record_on_disk_is_a_miss_and_is_replaced(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await make_proxy(store=f"disk://{tmp_path}/store")
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + CHAT, json=BODY) as resp:
            key, first = resp.headers["X-Cache-Key"], await resp.json()
            assert resp.headers["X-Cache"] == "MISS"
        # Flip bytes of the stored record in the database file itself (outside the proxy).
        db = sqlite3.connect(tmp_path / "store" / "cache.sqlite3")
        with db:
            (value,) = db.execute("SELECT value FROM entries WHERE key = ?", (key,)).fetchone()
            broken = value[:-5] + bytes(b ^ 0xFF for b in value[-5:])
            db.execute("UPDATE entries SET value = ? WHERE key = ?", (broken, key))
        db.close()
        before = proxy.generations
        async with session.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.headers["X-Cache"] == "MISS"  # served as a miss, regenerated
            again = await resp.json()
        async with session.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.headers["X-Cache"] == "HIT"  # and replaced by a good record
    assert proxy.generations == before + 1
    assert again["choices"] == first["choices"]


async def test_record_of_another_request_under_the_key_is_a_miss(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy()
    other = {"messages": [{"role": "user", "content": "Hello!"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + CHAT, json=other) as resp:
            other_key = resp.headers["X-Cache-Key"]
        async with session.post(proxy.url + CHAT, json=BODY) as resp:
            key = resp.headers["X-Cache-Key"]
        # Simulate a hash collision: the record stored under `key` answers another request.
        await proxy.store.set(key, await _get(proxy.store, other_key))
        async with session.post(proxy.url + CHAT, json=BODY) as resp:
            assert resp.headers["X-Cache"] == "MISS"


async def _get(store: object, key: str) -> bytes:
    value = await store.get(key)  # type: ignore[attr-defined]
    assert isinstance(value, bytes)
    return value


async def test_full_queue_answers_503_with_retry_after(make_proxy: ProxyFactory) -> None:
    small = MlxRunner(MlxOptions(model=str(BUNDLED_MODEL), model_id="cacheproxy-demo",
                                 queue_size=1))
    await small.start()
    try:
        proxy = await make_proxy(the_runner=small)

        async def one(i: int, session: aiohttp.ClientSession) -> tuple[int, str | None]:
            body = {"prompt": f"The {i} owl", "max_tokens": 200, "logit_bias": NO_EOS}
            async with session.post(proxy.url + "/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status, resp.headers.get("Retry-After")

        async with aiohttp.ClientSession() as session:
            results = await asyncio.gather(*(one(i, session) for i in range(4)))
        statuses = [s for s, _ in results]
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        assert all(int(r or 0) >= 1 for s, r in results if s == 503)
    finally:
        await small.aclose()


async def test_generation_timeout_answers_504_and_stores_nothing(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy(generation_timeout=0.05)
    body = {"prompt": "The bear", "max_tokens": 400, "logit_bias": NO_EOS}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/completions", json=body) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "generation_timeout"
    assert await proxy.entries() == 0


async def test_byte_tokens_never_split_a_character_and_never_crash(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy()
    # Push the demo model towards the two byte tokens of "é" (0xC3 0xA9): it emits them in
    # orders that make whole characters and invalid sequences alike.
    first, second = demo_token("Ã"), demo_token("©")  # byte-level 0xC3, 0xA9
    body = {"prompt": "The fox", "max_tokens": 12, "stream": True,
            "logit_bias": {str(first): 100, str(second): 100}}
    pieces = []
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    event = orjson.loads(line[6:])  # every event is valid UTF-8 JSON
                    pieces.extend(c["text"] for c in event["choices"] if c["text"])
        body["stream"] = False
        async with session.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.headers["X-Cache"] == "HIT"
            whole = (await resp.json())["choices"][0]["text"]
    text = "".join(pieces)
    assert text == whole
    assert "é" in text or "\ufffd" in text, f"byte tokens were not exercised: {text!r}"
    for piece in pieces:
        assert piece.encode("utf-8").decode("utf-8") == piece


class BrokenStore:
    """A store whose every call fails.

    A fake on purpose: no real store fails on every call on demand (the Redis outage tests
    of the storage issue use a real server); this checks the proxy's side of the contract.
    """

    def __init__(self) -> None:
        self.calls = 0

    async def get(self, key: str) -> bytes | None:
        self.calls += 1
        raise BackendError("store is down")

    async def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        self.calls += 1
        raise BackendError("store is down")

    async def delete(self, key: str) -> bool:
        self.calls += 1
        raise BackendError("store is down")

    async def aclose(self) -> None:
        return None


async def test_store_errors_are_misses_never_5xx(runner: MlxRunner) -> None:
    store = BrokenStore()
    app = build_app(Settings(store="memory://", store_retry=60), runner=runner, store=store)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(5):
                async with session.post(f"http://127.0.0.1:{server.port}{CHAT}",
                                        json=BODY) as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Cache"] == "BYPASS; reason=store-unavailable"
                    assert resp.headers["Cache-Control"] == "no-store"
                    assert (await resp.json())["choices"][0]["message"]["content"]
        # The circuit breaker: one fast failure (plus the registry read at start-up), then
        # the dead store is left alone.
        assert store.calls == 2
        assert app[PROXY].counters["store_errors"] == 5
        assert app[PROXY].breaker.state == "open"
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
            metrics = await resp.text()
        assert "cacheproxy_store_breaker_open 1.0" in metrics
    finally:
        await server.close()


async def test_a_replaying_server_with_its_store_down_says_so(runner: MlxRunner) -> None:
    # (BrokenStore: a fake, as above.) Not a 404 not_recorded: it may well be recorded.
    app = build_app(Settings(store="memory://", replay=True), runner=runner, store=BrokenStore())
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{server.port}{CHAT}", json=BODY) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "store_unavailable"
    finally:
        await server.close()


class FlakyStore:
    """A memory store that can be switched off and on.

    A fake on purpose (the Redis stop/start test uses a real server); here the switch is
    what makes the breaker's recovery observable without waiting for a process restart.
    """

    def __init__(self) -> None:
        from backends.memory import MemoryBackend

        self.inner = MemoryBackend()
        self.down = False
        self.writes_down = False  # reads work, writes fail

    async def get(self, key: str) -> bytes | None:
        if self.down:
            raise BackendError("down")
        return await self.inner.get(key)

    async def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        if self.down or self.writes_down:
            raise BackendError("down")
        await self.inner.set(key, value, ttl)

    async def delete(self, key: str) -> bool:
        if self.down:
            raise BackendError("down")
        return await self.inner.delete(key)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_store_outage_bypasses_then_hits_resume(runner: MlxRunner) -> None:
    store = FlakyStore()
    app = build_app(Settings(store="memory://", store_retry=0.3), runner=runner, store=store)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}{CHAT}"
    try:
        async with aiohttp.ClientSession() as session:
            async def ask() -> str:
                async with session.post(url, json=BODY) as resp:
                    assert resp.status == 200
                    return resp.headers["X-Cache"]

            assert await ask() == "MISS"
            assert await ask() == "HIT"
            store.down = True
            assert [await ask() for _ in range(3)] == ["BYPASS; reason=store-unavailable"] * 3
            assert app[PROXY].counters["store_errors"] == 3  # once per request, repeats too
            store.down = False
            await asyncio.sleep(0.4)  # the breaker's cooldown
            assert await ask() == "HIT"
            assert app[PROXY].breaker.state == "closed"
    finally:
        await server.close()
        await store.aclose()


async def test_an_answer_the_store_failed_to_keep_says_so(runner: MlxRunner) -> None:
    store = FlakyStore()
    store.writes_down = True
    app = build_app(Settings(store="memory://", store_retry=60), runner=runner, store=store)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            caches = []
            for _ in range(2):
                async with session.post(f"http://127.0.0.1:{server.port}{CHAT}",
                                        json=BODY) as resp:
                    assert resp.status == 200
                    caches.append(resp.headers["X-Cache"])
        # Generated, and the write failed: not the MISS that means "stored"; then the
        # breaker is open and the next one goes around the store.
        assert caches == ["MISS; reason=store-unavailable", "BYPASS; reason=store-unavailable"]
        assert app[PROXY].counters["store_errors"] == 2  # the write, the refused lookup
    finally:
        await server.close()
        await store.aclose()
