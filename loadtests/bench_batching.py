"""Pinned-shape batching (#31): miss throughput and latency, --decode-slots 1 vs S, beside
mlx_lm.server's own batching, in one run.

    python loadtests/bench_batching.py              # Llama 1024x8 under OpenBLAS
    python loadtests/bench_batching.py --smoke      # small and quick
    OPENBLAS_NUM_THREADS=1 python loadtests/bench_batching.py --slots 1,8   # the README's setting

A random-weight Llama runs under OpenBLAS (`LD_PRELOAD`, the batch-variant runtime and much
faster than the wheel's BLAS) in a cacheproxy per S (in-process runner, memory store) and in
one mlx_lm.server. At each concurrency C, C clients each send --per-client requests one
after another; every request is a miss (its own prompt) of --max-tokens tokens, greedy.
Reported per (server, C): completion tokens per second over the wall time, and p50 / p99
of the request latency. Targets: S = 8 at 8 concurrent misses >= 5x S = 1's throughput; a
lone request (C = 1) at S = 8 within 1.2x of S = 1's latency. Writes bench_batching.{md,json,png}
into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # noqa: E402
    RESULTS,
    blas_env,
    children,
    figure,
    pct,
    run,
    runtime_line,
    save,
    start_proxy,
    start_upstream,
    table,
)

from cacheproxy.runners.demo.model import random_model  # noqa: E402

WORDS = ("fox", "owl", "bear", "hare", "seal", "wolf", "crane", "eats", "berries", "fish",
         "mice", "grass", "lives", "in", "the", "forest", "river", "snow", "field")


@dataclass(frozen=True, slots=True)
class Point:
    """One (server, concurrency) measurement."""

    server: str
    concurrency: int
    requests: int
    completion_tokens: int
    seconds: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float


def prompt(n: int) -> str:
    """A distinct question (every request is a miss), 20 to 40 words long."""
    words = [WORDS[(n * 7 + i * 3 + i * i) % len(WORDS)] for i in range(20 + n % 21)]
    return f"Question {n}: " + " ".join(words) + "?"


async def _client(session: aiohttp.ClientSession, url: str, model: str, first: int,
                  count: int, max_tokens: int, latencies: list[float]) -> int:
    tokens = 0
    for n in range(first, first + count):
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": prompt(n)}]}
        t0 = time.monotonic()
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{url}: {resp.status} {data}")
        latencies.append((time.monotonic() - t0) * 1000)
        tokens += int(data["usage"]["completion_tokens"])
    return tokens


async def measure(server: str, url: str, model: str, concurrency: int, per_client: int,
                  max_tokens: int, offset: int) -> Point:
    """C clients, each `per_client` misses in a row; prompts numbered from `offset`."""
    latencies: list[float] = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.monotonic()
        counts = await asyncio.gather(*(
            _client(session, url, model, offset + c * per_client, per_client, max_tokens,
                    latencies)
            for c in range(concurrency)))
        seconds = time.monotonic() - t0
    tokens = sum(counts)
    return Point(server, concurrency, len(latencies), tokens, round(seconds, 2),
                 round(tokens / seconds, 1), round(pct(latencies, 0.5), 1),
                 round(pct(latencies, 0.99), 1))


def _render(points: list[Point], out: Path, title: str) -> str:
    rows = [(p.server, p.concurrency, p.requests, p.completion_tokens, p.seconds,
             p.tokens_per_s, p.p50_ms, p.p99_ms) for p in points]
    text = table(("server", "C", "requests", "tokens", "s", "tokens/s", "p50 ms", "p99 ms"),
                 rows, "l")
    fig, axes = figure(1, 2, (11, 4.5))
    servers = list(dict.fromkeys(p.server for p in points))
    for server in servers:
        mine = [p for p in points if p.server == server]
        axes[0][0].plot([p.concurrency for p in mine], [p.tokens_per_s for p in mine], "o-",
                        label=server)
        axes[0][1].plot([p.concurrency for p in mine], [p.p99_ms for p in mine], "o-",
                        label=server)
    axes[0][0].set(xlabel="concurrent misses", ylabel="completion tokens/s", title=title)
    axes[0][1].set(xlabel="concurrent misses", ylabel="p99 latency (ms)", yscale="log")
    for ax in axes[0]:
        ax.legend()
    save(fig, out / "bench_batching.png")
    return text


def _summary(points: list[Point]) -> dict[str, float]:
    def at(server: str, c: int) -> Point | None:
        return next((p for p in points if p.server == server and p.concurrency == c), None)

    one8, s8 = at("proxy S=1", 8), at("proxy S=8", 8)
    one1, s81 = at("proxy S=1", 1), at("proxy S=8", 1)
    summary: dict[str, float] = {}
    if one8 and s8:
        summary["throughput_S8_over_S1_at_8"] = round(s8.tokens_per_s / one8.tokens_per_s, 2)
    if one1 and s81:
        summary["lone_latency_S8_over_S1"] = round(s81.p50_ms / one1.p50_ms, 3)
    return summary


def main(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    hidden, layers = (256, 2) if args.smoke else (args.hidden, args.layers)
    levels = [1, 4] if args.smoke else [int(c) for c in args.concurrency.split(",")]
    slots = [1, 4] if args.smoke else [int(s) for s in args.slots.split(",")]
    points: list[Point] = []
    with tempfile.TemporaryDirectory() as tmp, children() as procs:
        work = Path(tmp)
        model = random_model(work / f"llama-{hidden}x{layers}", hidden=hidden, layers=layers)
        blas = "openblas"
        blas_env(blas)  # fails early without OpenBLAS
        offset = 0
        servers = [(f"proxy S={s}", s) for s in slots] + [("mlx_lm.server", 0)]
        for name, s in servers:
            if s:
                server = start_proxy(procs, work, "--model", str(model), "--model-id", "m",
                                     "--store", "memory://", "--decode-slots", str(s),
                                     "--queue-size", "256", log_level="warning", blas=blas)
            else:
                server = start_upstream(procs, work, model, blas=blas)
            # One miss first, not counted: the first forward of a process pays for set-up.
            asyncio.run(measure(name, server.url, "m" if s else str(model), 1, 1,
                                args.max_tokens, 10**6 + offset))
            for c in levels:
                point = asyncio.run(measure(name, server.url, "m" if s else str(model), c,
                                            args.per_client, args.max_tokens, offset))
                offset += c * args.per_client
                points.append(point)
                print(f"{name} C={c}: {point.tokens_per_s} tokens/s, p50 {point.p50_ms} ms, "
                      f"p99 {point.p99_ms} ms", file=sys.stderr)
            server.kill()
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    title = (f"Llama {hidden}x{layers}, {args.max_tokens} tokens/miss, OpenBLAS "
             f"(OPENBLAS_NUM_THREADS={threads})")
    text = _render(points, out, title)
    summary = _summary(points)
    report = f"# Pinned-shape batching\n\n{runtime_line()}\n\n{title}\n\n{text}\n\n{summary}\n"
    (out / "bench_batching.md").write_text(report)
    (out / "bench_batching.json").write_text(json.dumps(
        {"runtime": runtime_line(), "model": {"hidden": hidden, "layers": layers},
         "max_tokens": args.max_tokens, "points": [asdict(p) for p in points],
         "summary": summary}, indent=2))
    print(report)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, two levels")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--slots", default="1,8,16")
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.per_client = 4, 1
    return args


if __name__ == "__main__":
    sys.exit(run(main, parse_args(), "bench_batching"))
