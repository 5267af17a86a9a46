"""kill -9 of the proxy during a burst of writes to the disk store loses nothing acknowledged."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

from tests.conftest import free_port

CLI = [sys.executable, "-m", "cacheproxy"]


def _start(store: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), "--store", store, "--no-watch"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("serve did not start")


async def test_kill_9_during_writes_keeps_every_acknowledged_entry(tmp_path: Path) -> None:
    store = f"disk://{tmp_path}/store"
    proc, url = _start(store)
    acknowledged: dict[str, str] = {}
    ten_acknowledged = asyncio.Event()
    prompts = [f"The {animal} number {i}" for i, animal in
               enumerate(["fox", "cat", "owl", "bear", "duck"] * 8)]

    async def one(session: aiohttp.ClientSession, prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 12}
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status == 200:
                    text = (await resp.json())["choices"][0]["text"]
                    acknowledged[prompt] = text
                    if len(acknowledged) >= 10:
                        ten_acknowledged.set()
        except (aiohttp.ClientError, json.JSONDecodeError):
            pass  # cut off by the kill: not acknowledged

    async with aiohttp.ClientSession() as session:
        burst = [asyncio.create_task(one(session, p)) for p in prompts]
        await ten_acknowledged.wait()
        os.kill(proc.pid, signal.SIGKILL)  # mid-burst: generations and writes in flight
        await asyncio.gather(*burst)
    proc.wait(timeout=10)
    assert 10 <= len(acknowledged) < len(prompts), "the kill did not land mid-burst"

    proc, url = _start(store)
    try:
        async with aiohttp.ClientSession() as session:
            for prompt, text in acknowledged.items():
                body = {"prompt": prompt, "max_tokens": 12}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.headers["X-Cache"] == "HIT", prompt  # acknowledged => stored
                    assert (await resp.json())["choices"][0]["text"] == text
            async with session.get(url + "/health") as resp:
                assert (await resp.json())["counters"]["corrupt_records"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    verify = await asyncio.to_thread(
        subprocess.run, [*CLI, "verify", "--store", store, "--json"], capture_output=True,
        text=True, timeout=120)
    report = json.loads(verify.stdout)
    assert verify.returncode == 0 and report["exact_match_rate"] == 1.0
    assert report["checked"] >= len(acknowledged)
