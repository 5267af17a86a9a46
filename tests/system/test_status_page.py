"""The status page in headless Chromium: it renders, and its numbers match /metrics."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ProxyFactory
from tests.e2e.test_operability import _metrics, _post, _requests

ARTIFACTS = Path(__file__).parents[2] / "test-artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=4000", "--window-size=1100,700"]


def chromium() -> str:
    """The browser binary, or a failure that says how to get it."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.fail("headless Chromium is needed for the status page test: "
                "apt-get install -y chromium (Debian's package; .ci/run installs it)")


async def _browser(*args: str, profile: Path) -> str:
    proc = await asyncio.create_subprocess_exec(
        chromium(), *FLAGS, f"--user-data-dir={profile}", *args,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0
    return out.decode()


async def test_status_page_renders_the_numbers_of_the_metrics(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    proxy = await make_proxy()
    for content in ("Hello!", "Hello!", "Hello!", "Tell me about the fox."):
        await _post(proxy, {"messages": [{"role": "user", "content": content}]})
    dom = await _browser("--dump-dom", proxy.url + "/", profile=tmp_path / "profile")
    assert 'data-loaded="1"' in dom, "the page's script did not run"

    def shown(element_id: str) -> str:
        match = re.search(rf'id="{element_id}">([^<]*)<', dom)
        assert match, element_id
        return match.group(1)

    m = await _metrics(proxy)
    hits, misses = _requests(m, "HIT"), _requests(m, "MISS")
    assert (hits, misses) == (2, 2)
    assert shown("hit-rate") == f"{100 * hits / (hits + misses):.1f} %"
    assert shown("requests") == str(int(hits + misses))
    assert shown("entries") == str(int(m[("cacheproxy_store_entries", ())]))
    assert shown("saved-tokens") == str(int(m[("cacheproxy_saved_tokens_total", ())]))
    async with aiohttp.ClientSession() as session, \
            session.get(proxy.url + "/health") as resp:
        health = await resp.json()
    assert shown("fingerprint") == health["fingerprint"]
    rows = re.search(r'id="models">(.*?)</tbody>', dom, re.S)
    assert rows, "no models table"
    cells = re.findall(r"<td>([^<]*)</td>", rows.group(1))
    (model,) = health["models"]  # one row per served model (#21)
    assert cells == [model["id"], model["fingerprint"], "idle, 0 queued",
                     str(model["generations"]), "0"]

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "status-page.png"
    shot.unlink(missing_ok=True)
    await _browser(f"--screenshot={shot}", proxy.url + "/", profile=tmp_path / "profile2")
    assert shot.exists() and shot.stat().st_size > 5000
