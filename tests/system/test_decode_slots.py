"""`--decode-slots S` (#31): every answer of a busy pinned batch is bit-identical to the same
request's answer alone at the same S, on a batch-variant runtime.

The property only shows where a row's bits depend on the batch's row count: the proxy runs
under Debian's OpenBLAS (`LD_PRELOAD`), with a random-weight Llama of hidden 512 and MLP
1408 (shapes whose `x @ W.T` rows change bits with M there). Sixteen requests (other prompt
lengths and max_tokens, a seeded sample, a json_schema answer, a forced tool call,
logit_bias, a stop sequence, penalties, logprobs with top alternatives) are sent to a
server all at once, staggered (joining and leaving mid-decode), and beside a client that
leaves mid-stream: every answer equal in the three runs. Alone: `cacheproxy verify` replays
the stored answers on a fresh runner at the same S, one request at a time (each alone in
the batch), comparing token ids, text, calls, finish and logprobs with their top
alternatives: 100 %. The control decodes the same batch at M = the rows in use instead of
S: some answer differs, so the test can fail on this runtime.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.runners.demo.model import random_model
from tests.conftest import free_port
from tests.harness.processes import openblas_env, serving

SLOTS = 8
THREADS = {"OPENBLAS_NUM_THREADS": "1"}  # the setting the README gives for --decode-slots:
# one BLAS thread, a prefill and a decode step on two cores at once (on one thread OpenBLAS
# changes a row's bits from M = 1 to M >= 3 rows here: the control's batches cross that)
STEP = 32
WORDS = ("fox", "owl", "bear", "hare", "seal", "wolf", "crane", "deer", "frog", "duck",
         "horse", "goat", "sheep", "eagle", "bee", "mouse")
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "animal", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
    "required": ["name", "legs"]}}}
NO_CACHE = {"Cache-Control": "no-cache"}  # generate again (the busy runs share a server)


def _bodies() -> list[dict[str, Any]]:
    """Sixteen requests: prompts of 3 to 93 words, 3 to 15 new tokens, every feature."""
    bodies = []
    for i in range(16):
        words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + (i * 37) % 91)]
        body: dict[str, Any] = {
            "model": "m", "max_tokens": 3 + (i * 5) % 13, "logprobs": True,
            "messages": [{"role": "user", "content": " ".join(words) + "?"}]}
        extra: dict[int, dict[str, Any]] = {
            1: {"temperature": 0.9, "top_p": 0.9, "seed": 11},
            2: {"response_format": SCHEMA, "max_tokens": 24},
            3: {"tools": [TOOL], "max_tokens": 20,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            4: {"logit_bias": {"10": 8.0, "20": -100}},
            5: {"stop": ["e", " a"], "max_tokens": 15},
            6: {"top_logprobs": 3},
            7: {"frequency_penalty": 0.5, "presence_penalty": 0.3},
            8: {"temperature": 0.7, "top_k": 20, "seed": 3, "top_logprobs": 2},
        }
        bodies.append({**body, **extra.get(i, {})})
    return bodies


def _answer(data: dict[str, Any]) -> dict[str, Any]:
    """What must be bit-identical: text, reasoning, calls, logprobs, finish, token count."""
    choice = data["choices"][0]
    message = dict(choice["message"])
    message["tool_calls"] = [c["function"] for c in message.get("tool_calls") or []]
    return {"message": message, "logprobs": choice.get("logprobs"),
            "finish_reason": choice["finish_reason"],
            "completion_tokens": data["usage"]["completion_tokens"]}


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                delay: float = 0.0) -> dict[str, Any]:
    await asyncio.sleep(delay)
    async with session.post(url + "/v1/chat/completions", json=body, headers=NO_CACHE) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Cache"].startswith("MISS")
        return _answer(await resp.json())


async def _leave_mid_stream(session: aiohttp.ClientSession, url: str) -> int:
    """A longer streamed answer whose client reads two events and leaves; events read."""
    body = {**_bodies()[0], "max_tokens": 40, "stream": True,
            "messages": [{"role": "user", "content": "a long answer, please"}]}
    read = 0
    async with session.post(url + "/v1/chat/completions", json=body, headers=NO_CACHE) as resp:
        async for line in resp.content:
            read += line.startswith(b"data: {")
            if read == 2:
                break
        resp.close()  # the client is gone: its slot frees at the next step
    return read


async def _busy(url: str, *, stagger: float = 0.0, leaver: bool = False
                ) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        sends = [_send(session, url, body, delay=i * stagger)
                 for i, body in enumerate(_bodies())]
        if not leaver:
            return list(await asyncio.gather(*sends))
        read, answers = await asyncio.gather(_leave_mid_stream(session, url),
                                             asyncio.gather(*sends))
        assert read == 2
        return list(answers)


def _first_difference(got: Any, want: Any, path: str = "") -> str:
    """Where two answers first differ (a failure names the token and both values)."""
    if isinstance(got, dict) and isinstance(want, dict):
        for k in want:
            if got.get(k) != want[k]:
                return _first_difference(got.get(k), want[k], f"{path}.{k}")
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for n, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{path}[{n}]")
    return f"{path}: {str(got)[:200]} != {str(want)[:200]}"


def _lane(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/health", timeout=5) as resp:
        return dict(json.loads(resp.read())["lane"])


CONTROL = """
import asyncio, sys
from aiohttp import web
from cacheproxy.cli.serve import build_app
from cacheproxy.cli.settings import Settings
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from policies.sampling import SamplingMode

async def main():
    model, port, step, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    runner = MlxRunner(MlxOptions(model=model, model_id="m", prefill_step=step,
                                  decode_slots=slots, unpinned_decode=True))
    await runner.start()
    settings = Settings(model=model, model_id="m", store="memory://", watch=False,
                        sampling=SamplingMode.SEEDED, prefill_step=step, decode_slots=slots)
    site_runner = web.AppRunner(build_app(settings, runner=runner))
    await site_runner.setup()
    await web.TCPSite(site_runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _unpinned(model: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """The busy batch on a lane that decodes at M = the rows in use (the control)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", CONTROL, str(model), str(port), str(STEP),
                             str(SLOTS)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the control server did not start"
            try:
                _lane(url)
                break
            except OSError:
                time.sleep(0.2)
        return asyncio.run(_busy(url))
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def variant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose rows change bits with the batch's row count under OpenBLAS."""
    return random_model(tmp_path_factory.mktemp("variant") / "llama-512x2", hidden=512,
                        layers=2, heads=8)


def test_a_busy_pinned_batch_answers_every_request_as_it_answers_it_alone(
        variant_model: Path, tmp_path: Path) -> None:
    env = {**openblas_env(), **THREADS}
    args = ("--model", str(variant_model), "--model-id", "m", "--prefill-step", str(STEP),
            "--decode-slots", str(SLOTS), "--sampling", "seeded", "--no-watch")
    store = f"disk://{tmp_path / 'store'}"
    with serving(*args, "--store", store, env=env) as url:
        at_once = asyncio.run(_busy(url))
        staggered = asyncio.run(_busy(url, stagger=0.03))
        beside_a_leaver = asyncio.run(_busy(url, leaver=True))
        deadline = time.monotonic() + 20
        while (lane := _lane(url))["slots_in_use"]:  # the leaver's fill goes on (and is stored)
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert lane["slots"] == SLOTS and lane["queued"] == 0
    assert lane["batch_occupancy"] > 1 / SLOTS  # rows did decode together
    assert sum(a["finish_reason"] == "length" for a in at_once) >= 8
    # The forced call is held to its grammar (a random model's city never ends: cut at
    # max_tokens, the call stays text).
    assert '"name": "get_weather", "arguments":{"city": "' in at_once[3]["message"]["content"]
    assert all(a["logprobs"]["content"] for a in at_once)
    for name, run in (("staggered", staggered), ("beside a leaver", beside_a_leaver)):
        for i, (got, want) in enumerate(zip(run, at_once, strict=True)):
            assert got == want, (f"request {i} sent {name} differs from its answer sent at "
                                 f"once: {_first_difference(got, want)}")

    # Alone: `cacheproxy verify` replays every stored answer (the last busy run's, and the
    # leaver's fill, which went on without its client) on a fresh runner at the same S, one
    # request at a time, each alone in the batch, and compares token ids, text, reasoning,
    # calls, finish and each token's logprob with its top alternatives (`replay.difference`):
    # all exact, so each busy run above equals its answers alone.
    out = subprocess.run([sys.executable, "-m", "cacheproxy", "verify", "--model",
                          str(variant_model), "--model-id", "m", "--prefill-step", str(STEP),
                          "--decode-slots", str(SLOTS), "--store", store, "--json"],
                         env=env, capture_output=True, text=True)
    report = json.loads(out.stdout)
    assert out.returncode == 0, out.stderr[-2000:]
    assert report["checked"] == 17 and report["exact_match_rate"] == 1.0, report["mismatches"]

    # The control: decoded at M = the rows in use, the same batch changes some answer.
    unpinned = _unpinned(variant_model, env)
    differ = [i for i, (got, want) in enumerate(zip(unpinned, at_once, strict=True))
              if got != want]
    assert differ, "unpinned batching matched too: this runtime cannot tell the difference"
    print(f"control: {len(differ)} of {len(at_once)} answers differ at M = the rows in use")


def test_serve_refuses_a_model_the_pinned_batch_cannot_serve_naming_the_setting(
        tmp_path: Path) -> None:
    """End to end, the start-up refusal: a Llama with a sliding-window layer (mlx-lm gives
    it a RotatingKVCache, which the per-row attention does not serve) makes `serve
    --decode-slots 4` exit 2 with an error naming the setting, before it listens. (Which S a
    BLAS's rows move at is the CPU's: that refusal is tested in tests/unit/runners/test_rows.py
    on a real Llama with the fault injected.)"""
    model = random_model(tmp_path / "llama-sliding", hidden=128, layers=2, heads=4)
    config = json.loads((model / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    (model / "config.json").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "cacheproxy", "serve", "--model", str(model),
                          "--model-id", "m", "--decode-slots", "4", "--store", "memory://",
                          "--port", str(free_port()), "--no-watch"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "invalid value for setting 'decode_slots': 4" in out.stderr
    assert "RotatingKVCache) is not mlx-lm's plain KVCache" in out.stderr
