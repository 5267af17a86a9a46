"""The store commands as a newcomer meets them: `inspect` takes the 12-digit key the access
log prints; `stats` of a store that keeps its bound to itself (Redis) prints no `None`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.cli.main import run
from cacheproxy.cli.settings import DEMO_MODEL_ID
from tests.conftest import ProxyFactory


async def test_inspect_takes_the_access_logs_key_prefix(
        make_proxy: ProxyFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"disk://{tmp_path / 'store'}"
    proxy = await make_proxy(store=store)
    body = {"model": DEMO_MODEL_ID, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        key = resp.headers["X-Cache-Key"]
    await proxy.stop()
    short = key.partition("/")[2][:12]  # what the access line's `key` shows
    capsys.readouterr()
    assert await asyncio.to_thread(run, ["inspect", short, "--store", store]) == 0
    assert f"key          {key}" in capsys.readouterr().out
    assert await asyncio.to_thread(run, ["inspect", key[:40], "--store", store]) == 0
    # Control: a prefix of no key is still "no entry" (exit 1); 1 in 16**12 it is this one's.
    other = "0" * 12 if not short.startswith("0" * 12) else "f" * 12
    assert await asyncio.to_thread(run, ["inspect", other, "--store", store]) == 1
    assert f"no entry {other}" in capsys.readouterr().err


async def test_stats_on_redis_prints_no_none(redis_url: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert await asyncio.to_thread(run, ["stats", "--store", redis_url]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "the server's own bound" in out, out
