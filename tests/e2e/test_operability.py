"""Operability: metrics, admin API, API keys and scope, Cache-Control, TTL, limits."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cacheproxy.cli.settings import Settings, build_settings
from cacheproxy.edge.state import PROXY
from policies.sampling import SamplingMode
from tests.conftest import Proxy, ProxyFactory
from tests.e2e.test_bad_input import _raw_post
from tests.e2e.test_proxy import NO_EOS

CHAT = "/v1/chat/completions"


def _body(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


async def _post(proxy: Proxy, body: dict[str, Any], headers: dict[str, str] | None = None,
                path: str = CHAT) -> tuple[int, dict[str, str], dict[str, Any]]:
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + path, json=body, headers=headers or {}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def _metrics(proxy: Proxy) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _requests(m: dict[Any, float], cache: str) -> float:
    return sum(v for (name, labels), v in m.items()
               if name == "cacheproxy_requests_total" and ("cache", cache) in labels)


async def test_counters_follow_a_known_sequence(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(sampling=SamplingMode.SEEDED)
    _, _, hello = await _post(proxy, _body("Hello!"))        # MISS
    await _post(proxy, _body("Hello!"))                      # HIT
    await _post(proxy, _body("Hello!"))                      # HIT
    await _post(proxy, _body("Hi!", temperature=0.9))        # BYPASS (unseeded sampling)
    long = {"prompt": "The cat", "max_tokens": 150, "logit_bias": NO_EOS}
    results = await asyncio.gather(*(_post(proxy, long, path="/v1/completions")
                                     for _ in range(3)))     # 1 MISS + 2 COALESCED
    assert sorted(h["X-Cache"] for _, h, _ in results) == ["COALESCED", "COALESCED", "MISS"]
    m = await _metrics(proxy)
    assert _requests(m, "MISS") == 2 and _requests(m, "HIT") == 2
    assert _requests(m, "BYPASS") == 1 and _requests(m, "COALESCED") == 2
    assert m[("cacheproxy_coalesced_followers_total", ())] == 2
    hello_tokens = hello["usage"]["completion_tokens"]
    long_tokens = results[0][2]["usage"]["completion_tokens"]
    assert long_tokens == 150
    # Tokens the cache cut: two hits of "Hello!" and two followers of the long generation.
    assert m[("cacheproxy_saved_tokens_total", ())] == 2 * hello_tokens + 2 * long_tokens
    assert m[("cacheproxy_saved_generation_seconds_total", ())] > 0
    assert m[("cacheproxy_generation_seconds_count", ())] == 3  # 2 misses + 1 bypass
    assert m[("cacheproxy_generated_tokens_total", ())] > 150
    assert m[("cacheproxy_store_entries", ())] == 2  # two stored misses (the registry is none)
    assert m[("cacheproxy_store_breaker_open", ())] == 0
    assert m[("cacheproxy_request_seconds_count", (("cache", "HIT"),))] == 2


async def test_admin_api_needs_its_token(make_proxy: ProxyFactory) -> None:
    off = await make_proxy()
    async with aiohttp.ClientSession() as session, \
            session.get(off.url + "/admin/stats") as resp:
        assert resp.status == 404  # no token configured: no admin API

    proxy = await make_proxy(admin_token="s3cret")
    _, headers, _ = await _post(proxy, _body("Where does the owl live?"))
    key = headers["X-Cache-Key"]
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/admin/stats") as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        async with session.get(proxy.url + "/admin/stats", headers=wrong) as resp:
            assert resp.status == 401
    # A byte that is not UTF-8 in the header: 401 too (was a 500 with a traceback).
    port = int(proxy.url.rsplit(":", 1)[1])
    head = b"GET /admin/stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n"
    assert (await _raw_post(port, head, []))[0] == 401
    async with aiohttp.ClientSession() as session:
        auth = {"Authorization": "Bearer s3cret"}
        async with session.get(proxy.url + "/admin/stats", headers=auth) as resp:
            assert resp.status == 200
            stats = await resp.json()
        assert stats["requests"]["MISS"] == 1 and stats["namespaces"][0]["entries"] == 1
        # One count of entries everywhere: the registry record is a key, not an entry.
        assert (stats["store"]["entries"], stats["store"]["keys"]) == (1, 2)
        async with session.get(proxy.url + f"/admin/entries/{key}", headers=auth) as resp:
            assert resp.status == 200
            view = await resp.json()
        assert view["provenance"]["fingerprint"] == key.split("/")[0]
        async with session.delete(proxy.url + f"/admin/entries/{key}", headers=auth) as resp:
            assert resp.status == 200
        async with session.get(proxy.url + f"/admin/entries/{key}", headers=auth) as resp:
            assert resp.status == 404
        await _post(proxy, _body("Where does the owl live?"))
        async with session.post(proxy.url + "/admin/purge", json={"all": True},
                                headers=auth) as resp:
            assert resp.status == 200 and (await resp.json())["removed"] == 1


async def test_api_keys_are_enforced_and_scope_the_cache(make_proxy: ProxyFactory) -> None:
    shared = await make_proxy(api_keys=("key-a", "key-b"))
    status, _, body = await _post(shared, _body("Hello!"))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, _ = await _post(shared, _body("Hello!"), {"Authorization": "Bearer wrong"})
    assert status == 401
    _, h1, _ = await _post(shared, _body("Hello!"), {"Authorization": "Bearer key-a"})
    _, h2, _ = await _post(shared, _body("Hello!"), {"Authorization": "Bearer key-b"})
    assert (h1["X-Cache"], h2["X-Cache"]) == ("MISS", "HIT")  # one answer for everybody

    scoped = await make_proxy(api_keys=("key-a", "key-b"), cache_scope="per-key")
    _, h1, _ = await _post(scoped, _body("Hello!"), {"Authorization": "Bearer key-a"})
    _, h2, _ = await _post(scoped, _body("Hello!"), {"Authorization": "Bearer key-b"})
    _, h3, _ = await _post(scoped, _body("Hello!"), {"Authorization": "Bearer key-a"})
    assert (h1["X-Cache"], h2["X-Cache"], h3["X-Cache"]) == ("MISS", "MISS", "HIT")
    assert h1["X-Cache-Key"] != h2["X-Cache-Key"]
    # Repeats (answered from the remembered hit) stay within their caller's scope.
    _, h4, _ = await _post(scoped, _body("Hello!"), {"Authorization": "Bearer key-b"})
    _, h5, _ = await _post(scoped, _body("Hello!"), {"Authorization": "Bearer key-a"})
    assert (h4["X-Cache-Key"], h5["X-Cache-Key"]) == (h2["X-Cache-Key"], h1["X-Cache-Key"])
    # No memo shared between tenants is keyed on the body alone (#19: else a tenant could
    # time whether another sent a body): the parse memo holds the body once per tenant.
    parsed = scoped.app[PROXY].memos.parser._memo.keys()
    assert len(parsed) == 2 and len({scope for _, scope, _ in parsed}) == 2
    assert all(scope for _, scope, _ in parsed)


async def test_cache_control_directives(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    q = _body("What does the bear eat?")
    status, h, _ = await _post(proxy, q, {"Cache-Control": "only-if-cached"})
    assert status == 504 and h["Content-Type"].startswith("application/json")
    _, h, _ = await _post(proxy, q, {"Cache-Control": "no-store"})
    assert h["X-Cache"] == "MISS; reason=no-store" and h["Cache-Control"] == "no-store"
    assert await proxy.entries() == 0
    _, h, first = await _post(proxy, q)
    assert h["X-Cache"] == "MISS" and h["Cache-Control"].startswith("max-age=")
    status, h, _ = await _post(proxy, q, {"Cache-Control": "only-if-cached"})
    assert status == 200 and h["X-Cache"] == "HIT" and "Age" in h
    _, h, again = await _post(proxy, q, {"Cache-Control": "no-cache"})
    assert h["X-Cache"] == "MISS; reason=no-cache"
    assert h["X-Cache-Revalidated"] == "match"  # the free reproducibility probe
    assert again["choices"] == first["choices"]
    _, h, _ = await _post(proxy, q, {"Cache-Control": "max-age=3600"})
    assert h["X-Cache"] == "HIT"
    _, h, _ = await _post(proxy, q, {"Cache-Control": "max-age=0"})
    assert h["X-Cache"] == "MISS; reason=max-age"
    _, h, _ = await _post(proxy, q, {"Cache-Control": "no-store"})
    assert h["X-Cache"] == "HIT"  # no-store does not stop serving what is stored


async def test_entry_ttl(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(ttl=0.5)
    _, h, _ = await _post(proxy, _body("Hi!"))
    assert h["X-Cache"] == "MISS" and h["Cache-Control"] == "max-age=0"
    _, h, _ = await _post(proxy, _body("Hi!"))
    assert h["X-Cache"] == "HIT"
    await asyncio.sleep(0.7)
    _, h, _ = await _post(proxy, _body("Hi!"))
    assert h["X-Cache"] == "MISS"


async def test_limits_have_clear_errors(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(max_in_flight=1, max_tokens_cap=64)
    status, _, body = await _post(proxy, _body("Hi!", max_tokens=65))
    assert status == 400 and body["error"]["param"] == "max_tokens" and "64" in \
        body["error"]["message"]
    long = {"prompt": "The fox", "max_tokens": 60, "logit_bias": NO_EOS}
    results = await asyncio.gather(*(_post(proxy, {**long, "prompt": f"The {i} fox"},
                                           path="/v1/completions") for i in range(4)))
    statuses = sorted(s for s, _, _ in results)
    assert statuses[0] == 200 and statuses[-1] == 503, statuses
    overloaded = next(b for s, _, b in results if s == 503)
    assert overloaded["error"]["code"] == "overloaded"


async def _status_codes(proxy: Proxy, token: str | None) -> tuple[int, int, int, int]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session:
        codes = []
        for path in ("/metrics", "/status.json", "/", "/health"):
            async with session.get(proxy.url + path, headers=headers) as resp:
                codes.append(resp.status)
    return codes[0], codes[1], codes[2], codes[3]


async def test_the_fleets_figures_are_for_who_may_read_them(make_proxy: ProxyFactory) -> None:
    # (#19) With an admin token the traffic figures are the admin's; with API keys only, a
    # key holder's; a page shell and /health stay open (load balancers poll /health).
    admin = await make_proxy(api_keys=("key-a",), admin_token="root", status_access="admin")
    assert await _status_codes(admin, None) == (401, 401, 200, 200)
    assert await _status_codes(admin, "key-a") == (401, 401, 200, 200)
    assert await _status_codes(admin, "root") == (200, 200, 200, 200)
    keyed = await make_proxy(api_keys=("key-a",), status_access="api-key")
    assert await _status_codes(keyed, None) == (401, 401, 200, 200)
    assert await _status_codes(keyed, "key-a") == (200, 200, 200, 200)
    public = await make_proxy(api_keys=("key-a",), status_access="public")
    assert await _status_codes(public, None) == (200, 200, 200, 200)


async def test_a_get_route_answers_head_with_its_head_and_no_body(
        make_proxy: ProxyFactory) -> None:
    # (#32) Claude Code probes `HEAD /` before its first request.
    proxy = await make_proxy(api_keys=("key-a",), admin_token="root", status_access="admin")
    async with aiohttp.ClientSession() as session:
        for path, status in (("/", 200), ("/health", 200), ("/metrics", 401)):
            async with session.get(proxy.url + path) as got:
                body = await got.read()
                assert got.status == status
            async with session.head(proxy.url + path) as head:
                assert head.status == status
                assert head.content_type == got.content_type
                # (/health carries the time: its float's digits may differ by one or two)
                slack = 3 if path == "/health" else 0
                assert abs(int(head.headers["Content-Length"]) - len(body)) <= slack
                assert await head.read() == b""
        # Control: a POST-only route does not answer HEAD.
        async with session.head(proxy.url + "/v1/messages") as head:
            assert head.status == 405


def test_status_access_auto_follows_the_tokens_that_are_set() -> None:
    assert Settings().status_readers == "public"
    assert Settings(api_keys=("k",)).status_readers == "api-key"
    assert Settings(api_keys=("k",), admin_token="t").status_readers == "admin"
    assert Settings(admin_token="t", status_access="public").status_readers == "public"
    with pytest.raises(ValueError, match="status-access admin"):
        build_settings({"status_access": "admin"}, {})
