"""Miss overhead of `cacheproxy serve --upstream` against calling mlx_lm.server directly.

A benchmark, not a test. It starts, on 127.0.0.1 only, a `python -m mlx_lm.server` serving a
copy of the demo model and `cacheproxy serve --upstream ... --store memory://` in front of it.
Then, one request at a time, it alternates a request straight to the upstream with the same
request through the proxy, each with a prompt of its own (so every proxied one is a MISS):
greedy, seed 0, every sampling parameter explicit, end tokens suppressed so each generates
exactly --max-tokens tokens. Whole and streamed. It prints a Markdown table (or --json) of
median and mean latencies and the overhead of the proxy, (proxy - direct) / direct.

    python loadtests/bench_upstream.py                    # 60 pairs, 32 tokens
    python loadtests/bench_upstream.py --requests 200 --max-tokens 64 --json
    python loadtests/bench_upstream.py --pin     # the proxy does not compete with the engine

Both servers are terminated on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

HOST = "127.0.0.1"
CHAT = "/v1/chat/completions"
START_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Children terminated (then killed) on the way out, whatever happens."""
    children: list[subprocess.Popen[bytes]] = []
    try:
        yield children
    finally:
        for proc in children:
            proc.terminate()
        for proc in children:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    """Poll GET url until it answers 200."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer")


def bodies(i: int, max_tokens: int, no_eos: dict[str, float], stream: bool
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Pair i: the body the proxy would send upstream (sent directly), and a client body
    for the proxy; different prompts of the same shape, so both are fresh."""
    from cacheproxy.canonical import RunnerDefaults, parse
    from cacheproxy.runners.upstream_wire import request_body
    from policies.sampling import SamplingMode

    def client(animal: str) -> dict[str, Any]:
        return {"model": "bench", "max_tokens": max_tokens, "logit_bias": no_eos,
                "stream": stream,
                "messages": [{"role": "user", "content": f"Tell me about the {animal} {i}."}]}

    defaults = RunnerDefaults(model_id="bench", aliases=frozenset(), max_tokens=256,
                              max_tokens_cap=4096, context_length=512)
    direct = request_body(parse(client("fox"), "chat", defaults,
                                SamplingMode.FORCE_GREEDY).request)
    if not stream:
        direct.update(stream=False)
        del direct["stream_options"]
    return direct, client("owl")


async def timed(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                ) -> tuple[float, str]:
    """Seconds to the last byte, and X-Cache."""
    started = time.perf_counter()
    async with session.post(url + CHAT, json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status}")
        return time.perf_counter() - started, resp.headers.get("X-Cache", "")


async def measure(upstream: str, proxy: str, args: argparse.Namespace,
                  no_eos: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    connector = aiohttp.TCPConnector(force_close=True)  # mlx_lm.server is HTTP/1.0 anyway
    async with aiohttp.ClientSession(connector=connector) as session:
        for stream in (False, True):
            direct_s, proxy_s = [], []
            for i in range(-args.warmup, args.requests):
                d_body, p_body = bodies(i + 100_000 * stream, args.max_tokens, no_eos, stream)
                d, _ = await timed(session, upstream, d_body)
                p, cache = await timed(session, proxy, p_body)
                if cache != "MISS":
                    raise RuntimeError(f"expected a MISS, got {cache!r}")
                if i >= 0:
                    direct_s.append(d)
                    proxy_s.append(p)
            rows.append(row("stream" if stream else "whole", direct_s, proxy_s))
    return rows


def row(mode: str, direct: list[float], proxy: list[float]) -> dict[str, Any]:
    """Latencies in ms and the overhead of the proxy in percent."""
    # The median of per-pair differences cancels drift (other load on the machine).
    paired = statistics.median(p - d for d, p in zip(direct, proxy, strict=True))
    med_d, med_p = statistics.median(direct), statistics.median(proxy)
    mean_d, mean_p = statistics.fmean(direct), statistics.fmean(proxy)
    return {"mode": mode, "n": len(direct),
            "direct_median_ms": round(med_d * 1000, 2), "proxy_median_ms": round(med_p * 1000, 2),
            "overhead_median_pct": round((med_p - med_d) / med_d * 100, 2),
            "direct_mean_ms": round(mean_d * 1000, 2), "proxy_mean_ms": round(mean_p * 1000, 2),
            "overhead_mean_pct": round((mean_p - mean_d) / mean_d * 100, 2),
            "overhead_median_ms": round((med_p - med_d) * 1000, 2),
            "overhead_paired_ms": round(paired * 1000, 2),
            "overhead_paired_pct": round(paired / med_d * 100, 2)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start both servers, measure, stop them."""
    from cacheproxy.demo_model import BUNDLED_MODEL, write_copy

    eos = json.loads((BUNDLED_MODEL / "config.json").read_text())["eos_token_id"]
    no_eos = {str(t): -100.0 for t in eos}
    with tempfile.TemporaryDirectory() as tmp, processes() as children, \
            (Path(tmp) / "servers.log").open("wb") as log:
        model = write_copy(Path(tmp) / "model")
        up_port, proxy_port = free_port(), free_port()
        upstream, proxy = f"http://{HOST}:{up_port}", f"http://{HOST}:{proxy_port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        children.append(subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", HOST,
             "--port", str(up_port)], stdout=log, stderr=subprocess.STDOUT, env=env))
        wait_ready(upstream + "/health", children[0])
        children.append(subprocess.Popen(
            [sys.executable, "-m", "cacheproxy", "serve", "--upstream", upstream,
             "--model-dir", str(model), "--model-id", "bench", "--store", "memory://",
             "--port", str(proxy_port), "--no-watch", "--log-level", "warning",
             "--digest-memo", str(Path(tmp) / "memo.json")],
            stdout=log, stderr=subprocess.STDOUT, env=env))
        wait_ready(proxy + "/health", children[1])
        if args.pin:  # the engine alone on core 0; the proxy and this client on core 1
            os.sched_setaffinity(children[0].pid, {0})
            for pid in (children[1].pid, 0):
                os.sched_setaffinity(pid, {1})
        return asyncio.run(measure(upstream, proxy, args, no_eos))


def main() -> None:
    """Parse flags, run, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="pairs per mode")
    parser.add_argument("--warmup", type=int, default=5, help="pairs per mode not counted")
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=32)
    parser.add_argument("--pin", action="store_true",
                        help="upstream on core 0, proxy and client on core 1 (Linux)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    pinned = ", upstream pinned to core 0, proxy and client to core 1" if args.pin else ""
    print(f"{args.requests} sequential misses per mode, {args.max_tokens} tokens each"
          f"{pinned}\n")
    print("| mode | direct median ms | proxy median ms | overhead (medians) | "
          "overhead (median of pairs) | overhead (means) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['direct_median_ms']} | {r['proxy_median_ms']} | "
              f"{r['overhead_median_pct']} % ({r['overhead_median_ms']} ms) | "
              f"{r['overhead_paired_pct']} % ({r['overhead_paired_ms']} ms) | "
              f"{r['overhead_mean_pct']} % |")


if __name__ == "__main__":
    main()
