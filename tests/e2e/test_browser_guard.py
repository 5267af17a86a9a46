"""A proxy on loopback without API keys refuses what a browser sends for another site: a
cross-site Origin, a text/plain JSON POST, a DNS-rebound Host name (403, the API's error
shape, before any generation); keys or an allow-list lift it. X-Request-Id is bounded."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from cacheproxy.cli.settings import DEMO_MODEL_ID
from tests.conftest import ProxyFactory

BODY = {"model": DEMO_MODEL_ID, "max_tokens": 4,
        "messages": [{"role": "user", "content": "What does the fox eat?"}]}


async def chat(url: str, headers: dict[str, str], *, text_plain: bool = False
               ) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        kwargs: dict[str, Any] = {"data": json.dumps(BODY),
                                  "headers": {**headers, "Content-Type": "text/plain"}} \
            if text_plain else {"json": BODY, "headers": headers}
        async with session.post(url + "/v1/chat/completions", **kwargs) as resp:
            return resp.status, await resp.json()


async def get(url: str, path: str, headers: dict[str, str]) -> int:
    async with aiohttp.ClientSession() as session, \
            session.get(url + path, headers=headers) as resp:
        return resp.status


async def test_a_cross_site_post_is_refused_before_it_generates(make_proxy: ProxyFactory
                                                                 ) -> None:
    proxy = await make_proxy()
    before = proxy.generations
    status, answer = await chat(proxy.url, {"Origin": "https://evil.example"})
    assert status == 403, answer
    assert answer["error"]["code"] == "cross_site_request"
    assert "evil.example" in answer["error"]["message"]
    status, answer = await chat(proxy.url, {"Origin": "null"})
    assert status == 403, answer
    status, answer = await chat(proxy.url, {}, text_plain=True)  # a form or beacon's POST
    assert (status, answer["error"]["code"]) == (403, "cross_site_request")
    assert proxy.generations == before
    # Controls: the same request from an API client, and from the proxy's own page, is served.
    assert (await chat(proxy.url, {}))[0] == 200
    assert (await chat(proxy.url, {"Origin": proxy.url}))[0] == 200
    assert proxy.generations == before + 1


async def test_a_dns_rebound_host_is_refused_on_every_route(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    port = proxy.url.rsplit(":", 1)[1]
    rebound = {"Host": f"evil.example.com:{port}"}
    for path in ("/status.json", "/v1/models", "/health", "/nothing-here"):
        assert await get(proxy.url, path, rebound) == 403, path
    status, answer = await chat(proxy.url, rebound)
    assert (status, answer["error"]["code"]) == (403, "host_not_allowed")
    assert await get(proxy.url, "/status.json", {"Host": f"10.1.2.3:{port}"}) == 403
    # Controls: loopback names are this proxy's.
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert await get(proxy.url, "/status.json", {"Host": host}) == 200


async def test_allow_lists_and_api_keys_lift_the_guard(make_proxy: ProxyFactory) -> None:
    listed = await make_proxy(allowed_hosts=("proxy.internal.example",),
                              allowed_origins=("https://app.example",))
    port = listed.url.rsplit(":", 1)[1]
    assert await get(listed.url, "/status.json",
                     {"Host": f"proxy.internal.example:{port}"}) == 200
    assert (await chat(listed.url, {"Origin": "https://app.example"}))[0] == 200
    assert (await chat(listed.url, {"Origin": "https://other.example"}))[0] == 403
    keyed = await make_proxy(api_keys=("sk-1",))
    auth = {"Authorization": "Bearer sk-1"}
    assert (await chat(keyed.url, {**auth, "Origin": "https://evil.example"}))[0] == 200


async def test_a_long_or_unprintable_request_id_is_replaced_not_echoed(
        make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session:
        for sent in ("r" * 4000, "r" * 129):  # (8 KB: aiohttp's own 400)
            async with session.get(proxy.url + "/health", headers={"X-Request-Id": sent}) as r:
                got = r.headers["X-Request-Id"]
                assert got != sent and 0 < len(got) <= 128
        ok = "req-" + "x" * 124  # control: a printable id of 128 characters is the client's
        async with session.get(proxy.url + "/health", headers={"X-Request-Id": ok}) as r:
            assert r.headers["X-Request-Id"] == ok
