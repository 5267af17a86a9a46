"""Edge cases found in review: directives on a leasing store, only-if-cached, redaction,
device-scoped namespaces, generation_config.json, a client leaving mid-stream or mid-body, a
body that does not decode."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from structlog.testing import capture_logs

from backends import open_backend, redact_url
from backends.base import DistributedLock
from backends.memory import MemoryBackend
from cacheproxy.cli.serve import build_app
from cacheproxy.cli.settings import Settings
from cacheproxy.edge.state import PROXY
from cacheproxy.keys import fingerprint as fp
from cacheproxy.runners.demo.model import BUNDLED_MODEL, write_copy
from cacheproxy.runners.mlx import MlxRunner
from cacheproxy.service.namespaces import Registry
from policies.sampling import SamplingMode
from tests.conftest import ProxyFactory, free_port
from tests.e2e.test_operability import _metrics, _post
from tests.e2e.test_proxy import NO_EOS

Q = {"messages": [{"role": "user", "content": "What does the duck eat?"}]}


async def test_no_cache_regenerates_on_a_leasing_store(
    make_proxy: ProxyFactory, redis_url: str
) -> None:
    proxy = await make_proxy(store=redis_url)
    assert isinstance(proxy.store, DistributedLock)
    _, h, _ = await _post(proxy, Q)
    assert h["X-Cache"] == "MISS"
    before = proxy.generations
    _, h, _ = await _post(proxy, Q, {"Cache-Control": "no-cache"})
    assert h["X-Cache"] == "MISS; reason=no-cache" and h["X-Cache-Revalidated"] == "match"
    assert proxy.generations == before + 1  # really generated, not replayed from the store


async def test_only_if_cached_never_generates(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(sampling=SamplingMode.SEEDED)
    await _post(proxy, Q)
    before = proxy.generations
    for headers, body in [({"Cache-Control": "only-if-cached, max-age=0"}, Q),
                          ({"Cache-Control": "only-if-cached, no-cache"}, Q),
                          ({"Cache-Control": "only-if-cached"}, {**Q, "temperature": 0.9})]:
        status, _, answer = await _post(proxy, body, headers)
        assert status == 504 and answer["error"]["code"] == "not_cached"
    assert proxy.generations == before


def test_tiered_over_redis_leases_through_l2(redis_url: str) -> None:
    assert isinstance(open_backend("tiered+" + redis_url), DistributedLock)
    assert not isinstance(open_backend("tiered+memory://"), DistributedLock)


def test_store_urls_are_redacted_for_logs() -> None:
    assert redact_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://u:pw@h/0?password=x&socket_timeout=1") == \
        "rediss://u:***@h/0?password=***&socket_timeout=1"
    assert redact_url("disk:///tmp/store") == "disk:///tmp/store"


async def test_device_scoped_namespaces_do_not_supersede_each_other() -> None:
    registry = Registry(MemoryBackend())
    base = fp.compute("demo", BUNDLED_MODEL)
    mac, linux = (dataclasses.replace(base, device=d) for d in ("Darwin-arm64", "Linux-x86"))
    assert await registry.observe(mac) == []
    assert await registry.observe(linux) == []  # another machine, not an upgrade
    upgraded = dataclasses.replace(linux, engine_version="9.9")
    assert await registry.observe(upgraded) == [linux.digest]


def test_generation_config_is_part_of_the_fingerprint(tmp_path: Path) -> None:
    model = write_copy(tmp_path / "m")
    before = fp.compute("demo", model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    after = fp.compute("demo", model)
    assert after.config_digest != before.config_digest and after.digest != before.digest
    assert model / "generation_config.json" in fp.watched_files(model)


async def test_a_client_leaving_mid_stream_is_not_a_server_error(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy()
    body = {"prompt": "The horse", "max_tokens": 300, "stream": True, "logit_bias": NO_EOS}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/completions", json=body) as resp:
        await resp.content.readline()
    for _ in range(100):  # the shared fill goes on after the client left; let it finish
        if len(proxy.app[PROXY].flights) == 0:
            break
        await asyncio.sleep(0.05)
    _, h, _ = await _post(proxy, {**body, "stream": False}, path="/v1/completions")
    assert h["X-Cache"] == "HIT"
    m = await _metrics(proxy)
    errors = sum(v for (name, labels), v in m.items()
                 if name == "cacheproxy_requests_total" and ("status", "500") in labels)
    assert errors == 0


def test_hot_memos_are_bounded_by_bytes_too() -> None:
    from cacheproxy.service.memos import LRU

    lru: LRU[str, bytes] = LRU(100, max_bytes=1000)
    for i in range(10):
        lru.put(f"k{i}", b"x", size=300)
    assert [k for k in (f"k{i}" for i in range(10)) if lru.get(k) is not None] == \
        ["k7", "k8", "k9"]
    lru.put("huge", b"x", size=5000)  # bigger than the bound: not kept, nothing evicted
    assert lru.get("huge") is None and lru.get("k9") is not None


async def test_a_waiting_replica_is_woken_by_the_release(redis_url: str) -> None:
    from cacheproxy.service.fleet import Fleet, Lease

    owner_store, waiter_store = open_backend(redis_url), open_backend(redis_url)
    assert isinstance(owner_store, DistributedLock) and isinstance(waiter_store, DistributedLock)
    owner = Fleet(owner_store, lock_ttl=5)
    waiter = Fleet(waiter_store, lock_ttl=5, poll=2.0)  # polling alone would take >= 2 s
    stored: list[str] = []

    async def lookup() -> str | None:
        return stored[0] if stored else None

    lease = await owner.lead_or_follow("ns/key", lookup)
    assert isinstance(lease, Lease)
    follower = asyncio.create_task(waiter.lead_or_follow("ns/key", lookup))
    await asyncio.sleep(0.3)  # the follower is subscribed and waiting
    started = asyncio.get_running_loop().time()
    stored.append("the answer")
    await lease.release()  # unlock + PUBLISH
    assert await follower == "the answer"
    assert asyncio.get_running_loop().time() - started < 1.0  # woken, not polled
    await owner_store.aclose()
    await waiter_store.aclose()


def test_breaker_probe_is_freed_when_the_probing_call_is_abandoned() -> None:
    from cacheproxy.service.breaker import Breaker, StoreUnavailable

    now = [0.0]
    breaker = Breaker(cooldown=1.0, clock=lambda: now[0])
    breaker.failed()
    assert breaker.state == "open"
    now[0] = 2.0
    breaker.allow()  # half-open: this call probes
    try:
        breaker.allow()  # a second call while the probe runs is refused
        raise AssertionError("a second probe was let through")
    except StoreUnavailable:
        pass
    breaker.abandoned()  # the probe was cancelled: neither verdict
    breaker.allow()  # so another call may probe
    breaker.succeeded()
    assert breaker.state == "closed"


async def test_a_follower_stops_waiting_after_the_generation_timeout(redis_url: str) -> None:
    from cacheproxy.service.fleet import Fleet, Lease

    store = open_backend(redis_url)
    assert isinstance(store, DistributedLock)
    owner = Fleet(store, lock_ttl=30)
    follower = Fleet(store, lock_ttl=30, poll=0.02, wait=0.3)

    async def nothing() -> None:
        return None

    lease = await owner.lead_or_follow("ns/slow", nothing)
    assert isinstance(lease, Lease)
    started = asyncio.get_running_loop().time()
    assert await follower.lead_or_follow("ns/slow", nothing) is None  # generate without it
    assert asyncio.get_running_loop().time() - started < 2.0
    await lease.release()
    await store.aclose()


async def test_admin_store_errors_are_503(runner: MlxRunner) -> None:
    from aiohttp.test_utils import TestServer

    from cacheproxy.cli.serve import build_app
    from cacheproxy.cli.settings import Settings
    from tests.conftest import free_port
    from tests.e2e.test_faults import BrokenStore

    app = build_app(Settings(store="memory://", admin_token="t"), runner=runner,
                     store=BrokenStore())
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{server.port}/admin/entries/ns/k",
                headers={"Authorization": "Bearer t"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "store_unavailable"
    finally:
        await server.close()


async def _raw(proxy_url: str, head: bytes, body: bytes, *, hang_up: bool,
               started: Callable[[], bool] = lambda: True) -> bytes:
    """A POST written by hand: a body no client library would send, or half of one."""
    host, port = proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\n" + head + b"\r\n" + body)
    await writer.drain()
    if hang_up:
        for _ in range(1000):  # until the server took the request (its handler then runs)
            if started():
                break
            await asyncio.sleep(0.01)
        writer.close()
        return b""
    answer = await reader.read(4096)
    writer.close()
    return answer


async def test_a_body_that_does_not_decode_is_a_400_and_a_client_gone_mid_body_a_499(
    runner: MlxRunner,
) -> None:
    # Served as `cacheproxy serve` serves (AppRunner: a handler is not cancelled when its
    # client leaves; aiohttp's TestServer would cancel it).
    app = build_app(Settings(store="memory://", model=str(BUNDLED_MODEL)), runner=runner)
    served = web.AppRunner(app, access_log=None)
    await served.setup()
    port = free_port()
    await web.TCPSite(served, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        body = json.dumps(Q).encode()
        answer = await _raw(url, b"Content-Encoding: gzip\r\nContent-Length: %d\r\n"
                            % len(body), body, hang_up=False)
        assert answer.startswith(b"HTTP/1.1 400") and b'"code":"invalid_request_error"' in answer
        assert b"Content-Encoding" in answer and b"Connection: close" in answer
        with capture_logs() as logs:
            assert served.server is not None
            taken = served.server.requests_count  # (the 400 above)
            await _raw(url, b"Content-Length: %d\r\n" % (len(body) + 50), body, hang_up=True,
                       started=lambda: served.server is not None and
                       served.server.requests_count > taken)
            for _ in range(400):  # (up to 20 s on a loaded machine)
                if any(e.get("status") == 499 for e in logs):
                    break
                await asyncio.sleep(0.05)
        assert [e["status"] for e in logs if e["event"] == "request"] == [499], logs
        assert not [e for e in logs if e["event"] == "unhandled_error"]
    finally:
        await served.cleanup()
