"""Fault scenarios of loadtests/faults.py that need no process boundary, run in-process
against the session model (the script runs them full size, each with a server of its own):
clients hanging up mid-stream, hostile or malformed requests, a schema flood and slow
request bodies (loadtests/hostile_load.py)."""

from __future__ import annotations

import asyncio

from cacheproxy.edge.aiohttp_adapter import ConnectionGuard
from cacheproxy.edge.state import BODIES
from loadtests.faults import disconnect_storm, hostile_against
from loadtests.hostile_load import schema_flood_against, slow_bodies_against
from tests.conftest import ProxyFactory


async def test_streams_cut_after_the_first_chunk_lose_no_fill(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(queue_size=1024)
    out = await disconnect_storm(proxy.url, storm=12, tokens=32, model="cacheproxy-demo")
    assert out.ok and out.sent == 12 and out.failed == 0, out.notes
    assert set(out.caches) <= {"HIT", "COALESCED"}, out.caches


async def test_hostile_requests_get_no_5xx_and_the_server_answers_after(
        make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(max_tokens_cap=8, default_max_tokens=8, max_body_bytes=65536)
    out = await asyncio.to_thread(hostile_against, proxy.url, 150, model="cacheproxy-demo")
    assert out.ok, out.notes  # no 5xx; alive; /health and a valid chat answer 200 after
    assert out.sent >= 150 and out.extra["examples_5xx"] == [], out.extra


async def test_a_schema_flood_leaves_hits_fast(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(max_schema_properties=20_000, schema_timeout=60.0)
    flood = await schema_flood_against(proxy.url, properties=1500, flooders=1, seconds=2.0,
                                       model="cacheproxy-demo")
    assert flood.flood_statuses[504] >= 1, flood.flood_statuses  # parsed, while HITs ran
    assert len(flood.hit_ms) >= 10 and flood.median_ms < 50, flood.hit_ms


async def test_slow_bodies_leave_fresh_and_keep_alive_clients_served(
        make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(body_min_rate=0.0)  # (the guard alone makes room)
    assert proxy.server is not None and proxy.server.runner is not None
    server = proxy.server.runner.server
    assert server is not None
    guard = ConnectionGuard(server, 40, bodies=proxy.app[BODIES])  # as serve installs it
    guard.install()
    got = await asyncio.to_thread(slow_bodies_against, proxy.url, slow=60, fresh=20,
                                  keep_alive=3, model="cacheproxy-demo")
    assert got.fresh_share >= 0.95, got.fresh_statuses
    assert got.keep_alive_served == got.keep_alive_sent >= 3, got.keep_alive_statuses
    assert guard.counters["connections_refused"] == 0, guard.counters
