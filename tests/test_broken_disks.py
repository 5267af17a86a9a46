"""A disk store on a full or read-only disk (#19), through a real proxy on a real port: every
stored entry is still a HIT, a new answer is served and said not stored (`X-Cache: MISS;
reason=store-full` or `store-read-only`), counted in /metrics, and the store is never taken
for down (the breaker stays closed). A 1 MB tmpfs (mounting takes root, as .ci/run has:
the tests fail, not skip, without it)."""

from __future__ import annotations

import asyncio
import errno
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import Proxy, ProxyFactory
from tests.test_operability import _metrics

CHAT = "/v1/chat/completions"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs, unmounted at the end."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"could not mount a 1 MB tmpfs on {mount}: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path) -> int:
    """Fill the file system of `directory` to the brim with a junk file; its size."""
    written = 0
    with (directory / "junk").open("wb", buffering=0) as junk:
        try:
            while True:
                written += junk.write(b"\0" * 4096)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return written


async def _ask(proxy: Proxy, content: str, **extra: Any) -> tuple[str, bytes]:
    """(X-Cache, body) of one chat request."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12, **extra}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Cache"], await resp.read()


def _choices(body: bytes) -> Any:
    return json.loads(body)["choices"]


STORED = [f"Where does the {animal} live?" for animal in ("fox", "owl", "cat")]


async def _store_some(proxy: Proxy) -> dict[str, bytes]:
    answers = {}
    for content in STORED:
        cache, answers[content] = await _ask(proxy, content)
        assert cache == "MISS"
    return answers


async def _stored_ones_hit(proxy: Proxy, answers: dict[str, bytes]) -> None:
    for content, first in answers.items():
        cache, again = await _ask(proxy, content)
        assert cache == "HIT", content
        assert _choices(again) == _choices(first)


async def test_a_full_disk_serves_every_stored_entry_and_says_store_full(
    make_proxy: ProxyFactory, tiny_disk: Path
) -> None:
    proxy = await make_proxy(store=f"disk://{tiny_disk}")
    answers = await _store_some(proxy)
    assert _fill(tiny_disk) > 0
    refused = None
    for i in range(30):  # (a write may still fit in a page the database file holds)
        cache, body = await _ask(proxy, f"What does the duck eat? ({i})")
        if cache != "MISS":
            refused = (f"What does the duck eat? ({i})", cache, body)
            break
    assert refused is not None, "every answer was stored on a full disk"
    content, cache, body = refused
    assert cache == "MISS; reason=store-full"
    again, body_again = await _ask(proxy, content)  # not stored: generated again, the same
    assert again == "MISS; reason=store-full"
    assert _choices(body_again) == _choices(body)
    # Streamed, the headers went out before the store refused: an SSE comment says it.
    cache, events = await _ask(proxy, content, stream=True)
    assert cache == "MISS" and b": x-cache=MISS; reason=store-full\n\n" in events
    await _stored_ones_hit(proxy, answers)
    m = await _metrics(proxy)
    assert m[("cacheproxy_store_writes_refused", (("reason", "store-full"),))] == 3
    assert m[("cacheproxy_requests_total", (("cache", "MISS"), ("endpoint", CHAT),
                                            ("reason", "store-full"), ("status", "200")))] == 3
    assert m[("cacheproxy_store_breaker_open", ())] == 0
    assert m[("cacheproxy_store_errors", ())] == 0  # full is not down


async def test_a_read_only_store_serves_every_stored_entry_and_says_store_read_only(
    make_proxy: ProxyFactory, tiny_disk: Path
) -> None:
    writer = await make_proxy(store=f"disk://{tiny_disk}")
    answers = await _store_some(writer)
    await writer.stop()
    await writer.store.aclose()
    await asyncio.to_thread(subprocess.run, ["mount", "-o", "remount,ro", str(tiny_disk)],
                            check=True)
    proxy = await make_proxy(store=f"disk://{tiny_disk}")
    await _stored_ones_hit(proxy, answers)
    cache, _ = await _ask(proxy, "What does the duck eat?")
    assert cache == "MISS; reason=store-read-only"
    async with aiohttp.ClientSession() as session, \
            session.get(proxy.url + "/health") as resp:
        counters = (await resp.json())["counters"]
    assert counters["store_read_only"] == 1 and counters["store_errors"] == 0
    m = await _metrics(proxy)
    assert m[("cacheproxy_store_writes_refused", (("reason", "store-read-only"),))] == 1
    assert m[("cacheproxy_store_breaker_open", ())] == 0
