"""kill -9 of the proxy during a burst of writes to the disk store loses nothing acknowledged."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import aiohttp

from tests.harness.processes import CLI, Child, Procs, start_serve


def _start(procs: Procs, store: str, log: Path) -> Child:
    return start_serve(procs, log, "--store", store, "--no-watch")


async def test_kill_9_during_writes_keeps_every_acknowledged_entry(tmp_path: Path,
                                                                   procs: Procs) -> None:
    store = f"disk://{tmp_path}/store"
    first = _start(procs, store, tmp_path / "first.log")
    url = first.url
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
        os.kill(first.pid, signal.SIGKILL)  # mid-burst: generations and writes in flight
        await asyncio.gather(*burst)
    first.proc.wait(timeout=10)
    assert 10 <= len(acknowledged) < len(prompts), "the kill did not land mid-burst"

    second = _start(procs, store, tmp_path / "second.log")
    async with aiohttp.ClientSession() as session:
        for prompt, text in acknowledged.items():
            body = {"prompt": prompt, "max_tokens": 12}
            async with session.post(second.url + "/v1/completions", json=body) as resp:
                assert resp.headers["X-Cache"] == "HIT", prompt  # acknowledged => stored
                assert (await resp.json())["choices"][0]["text"] == text
        async with session.get(second.url + "/health") as resp:
            assert (await resp.json())["counters"]["corrupt_records"] == 0
    assert second.stop() == 0
    verify = await asyncio.to_thread(
        subprocess.run, [*CLI, "verify", "--store", store, "--json"], capture_output=True,
        text=True, timeout=120)
    report = json.loads(verify.stdout)
    assert verify.returncode == 0 and report["exact_match_rate"] == 1.0
    assert report["checked"] >= len(acknowledged)
