"""Miss overhead of `cacheproxy serve --upstream` against calling mlx_lm.server directly.

A benchmark, not a test. It starts, on 127.0.0.1 only:
  * `python -m mlx_lm.server` serving a copy of the demo model;
  * `cacheproxy serve --upstream ... --store memory://` in front of it;
  * a bare aiohttp relay on uvloop (this file, `--_relay` mode) that passes requests to the
    upstream and its answers back, line by line: the cost of one more Python HTTP hop,
    the floor any proxy in front of mlx_lm.server pays.
Then, one request at a time, it takes turns: the upstream directly, the relay, the proxy,
each with a prompt of its own (so every proxied request is a MISS). Direct and relayed
requests carry the very body the proxy sends upstream (greedy, seed 0, every sampling
parameter explicit); end tokens are suppressed so each generates exactly --max-tokens
tokens. Whole and streamed answers. It prints a Markdown table (or --json): medians and
the overhead over direct, as the median of per-turn differences (which cancels drift from
other load on the machine), and the CPU time the relay and the proxy spent per request
(from /proc, Linux only): on 2 cores shared with the runner, the proxy's CPU is what slows
the generation, and it varies far less from run to run than the latency.

    python loadtests/bench_upstream.py                    # 60 turns, 32 tokens
    python loadtests/bench_upstream.py --requests 200 --max-tokens 128 --json

Every server is terminated on exit, on error and on Ctrl-C.
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
from bench_hit import cpu_seconds

HOST = "127.0.0.1"
CHAT = "/v1/chat/completions"
START_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def serve_relay(port: int, target: str) -> None:
    """`--_relay` mode: pass every POST to the upstream and relay its answer line by line."""
    import uvloop
    from aiohttp import web

    async def relay(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        async with session.post(target + request.path, data=await request.read(),
                                headers={"Content-Type": "application/json"}) as up:
            response = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            async for line in up.content:
                await response.write(line)
            await response.write_eof()
            return response

    async def main() -> None:
        app = web.Application()
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True))
        app.router.add_post(CHAT, relay)
        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, HOST, port).start()
        await asyncio.Event().wait()

    uvloop.run(main())


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
    """Turn i: the body the proxy would send upstream (for direct and relayed requests),
    and a client body for the proxy."""
    from cacheproxy.keys.canonical import RunnerDefaults, parse
    from cacheproxy.runners.upstream_wire import request_body
    from policies.sampling import SamplingMode

    def client(animal: str) -> dict[str, Any]:
        return {"model": "bench", "max_tokens": max_tokens, "logit_bias": no_eos,
                "stream": stream,
                "messages": [{"role": "user", "content": f"Tell me about the {animal} {i}."}]}

    defaults = RunnerDefaults(model_id="bench", aliases=frozenset(), max_tokens=256,
                              max_tokens_cap=4096, context_length=512)
    upstream = request_body(parse(client("fox"), "chat", defaults,
                                  SamplingMode.FORCE_GREEDY).request)
    if not stream:
        upstream.update(stream=False)
        del upstream["stream_options"]
    return upstream, client("owl")


async def timed(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                ) -> tuple[float, str]:
    """Seconds to the last byte, and X-Cache."""
    started = time.perf_counter()
    async with session.post(url + CHAT, json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status}")
        return time.perf_counter() - started, resp.headers.get("X-Cache", "")


async def measure(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace,
                  no_eos: dict[str, float]) -> list[dict[str, Any]]:
    """Seconds per request of each target, turn by turn, whole then streamed; and the CPU
    the relay and the proxy spent per request (they idle between their turns)."""
    rows = []
    connector = aiohttp.TCPConnector(force_close=True)  # mlx_lm.server is HTTP/1.0 anyway
    async with aiohttp.ClientSession(connector=connector) as session:
        for stream in (False, True):
            seconds: dict[str, list[float]] = {name: [] for name in urls}
            cpu: dict[str, float | None] = {}
            for i in range(-args.warmup, args.requests):
                if i == 0:
                    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
                for k, (name, url) in enumerate(urls.items()):
                    upstream_body, client_body = bodies(
                        (i * len(urls) + k) * 2 + stream, args.max_tokens, no_eos, stream)
                    took, cache = await timed(
                        session, url, client_body if name == "proxy" else upstream_body)
                    if name == "proxy" and cache != "MISS":
                        raise RuntimeError(f"expected a MISS, got {cache!r}")
                    if i >= 0:
                        seconds[name].append(took)
            rows.append(row("stream" if stream else "whole", seconds))
            for name, pid in pids.items():
                before, after = cpu.get(name), cpu_seconds(pid)
                rows[-1][f"{name}_cpu_ms"] = None if before is None or after is None else \
                    round((after - before) / args.requests * 1000, 2)
    return rows


def row(mode: str, seconds: dict[str, list[float]]) -> dict[str, Any]:
    """Medians in ms; the overhead over direct as the median of per-turn differences."""
    direct = seconds["direct"]
    base = statistics.median(direct)
    out: dict[str, Any] = {"mode": mode, "n": len(direct),
                           "direct_ms": round(base * 1000, 2)}
    for name in ("relay", "proxy"):
        diff = statistics.median(s - d for s, d in zip(seconds[name], direct, strict=True))
        out[f"{name}_ms"] = round(statistics.median(seconds[name]) * 1000, 2)
        out[f"{name}_overhead_ms"] = round(diff * 1000, 2)
        out[f"{name}_overhead_pct"] = round(diff / base * 100, 2)
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the servers, measure, stop them."""
    from cacheproxy.runners.demo.model import BUNDLED_MODEL, write_copy

    eos = json.loads((BUNDLED_MODEL / "config.json").read_text())["eos_token_id"]
    no_eos = {str(t): -100.0 for t in eos}
    with tempfile.TemporaryDirectory() as tmp, processes() as children, \
            (Path(tmp) / "servers.log").open("wb") as log:
        model = write_copy(Path(tmp) / "model")
        ports = {name: free_port() for name in ("direct", "relay", "proxy")}
        urls = {name: f"http://{HOST}:{port}" for name, port in ports.items()}
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}

        def start(argv: list[str]) -> None:
            children.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             env=env))
            wait_ready(urls[list(urls)[len(children) - 1]] + "/health", children[-1])

        start([sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", HOST,
               "--port", str(ports["direct"])])
        start([sys.executable, __file__, "--_relay", str(ports["relay"]), urls["direct"]])
        start([sys.executable, "-m", "cacheproxy", "serve", "--upstream", urls["direct"],
               "--model-dir", str(model), "--model-id", "bench", "--store", "memory://",
               "--port", str(ports["proxy"]), "--no-watch", "--log-level", "warning",
               "--digest-memo", str(Path(tmp) / "memo.json")])
        pids = {"relay": children[1].pid, "proxy": children[2].pid}
        return asyncio.run(measure(urls, pids, args, no_eos))


def main() -> None:
    """Parse flags, run, print."""
    if len(sys.argv) == 4 and sys.argv[1] == "--_relay":
        serve_relay(int(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="turns per mode")
    parser.add_argument("--warmup", type=int, default=5, help="turns per mode not counted")
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.requests} sequential requests per target and mode, "
          f"{args.max_tokens} tokens each; overhead = median of per-turn differences\n")
    print("| mode | direct ms | bare relay ms | relay overhead | relay CPU ms | "
          "cacheproxy MISS ms | cacheproxy overhead | cacheproxy CPU ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['direct_ms']} | {r['relay_ms']} | "
              f"{r['relay_overhead_pct']} % ({r['relay_overhead_ms']} ms) | "
              f"{r['relay_cpu_ms'] if r['relay_cpu_ms'] is not None else '-'} | "
              f"{r['proxy_ms']} | {r['proxy_overhead_pct']} % ({r['proxy_overhead_ms']} ms) | "
              f"{r['proxy_cpu_ms'] if r['proxy_cpu_ms'] is not None else '-'} |")


if __name__ == "__main__":
    main()
