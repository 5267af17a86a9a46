"""Fault scenarios of loadtests/faults.py that need no process boundary, run in-process
against the session model (the script runs them full size, each with a server of its own):
clients hanging up mid-stream, and hostile or malformed requests."""

from __future__ import annotations

import asyncio

from loadtests.faults import disconnect_storm, hostile_against
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
