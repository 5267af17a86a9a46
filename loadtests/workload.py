"""A Zipf workload at a fixed arrival rate: directly to mlx_lm.server vs through cacheproxy.

An experiment, not a test. On 127.0.0.1 it starts a batching `python -m mlx_lm.server` on a
copy of the demo model and `cacheproxy serve --upstream <it> --store memory://` in front of
the same server (default force-greedy sampling). Requests are greedy chat completions
(max_tokens 32) whose prompt is drawn from a Zipf distribution over --distinct questions
about the demo model's animals (rank r has weight 1/r**s), sent open-loop at --rate requests
per second for --duration seconds: first all directly to the server (the honest baseline:
it batches concurrent requests), then the identical sequence through the proxy.

With `--decode-slots S` (repeatable), the same sequence is sent once more for each S to a
`cacheproxy serve` whose in-process runner generates on the same model with `--decode-slots S`
(pinned-shape batching, #31): each answer bit-identical to its answer alone at that S.

Reports the hit rate over time, p50/p99 latency of each, the generation seconds saved
(for every HIT or COALESCED answer, the latency of that prompt's MISS) and how many
generations single-flight avoided (COALESCED). Plots hit rate and latency over time.

    python loadtests/workload.py                        # 120 s per phase, 20 req/s, s=1.1
    python loadtests/workload.py --exponent 0.8 --rate 30 --duration 60
    python loadtests/workload.py --duration 60 --decode-slots 8   # + in-process, S = 8
    python loadtests/workload.py --smoke --out /tmp/w    # 3 s per phase
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

import aiohttp
from common import (
    PATH,
    RESULTS,
    animal_prompts,
    children,
    demo_model,
    figure,
    pct,
    run,
    runtime_line,
    save,
    start_proxy,
    start_upstream,
    table,
)


@dataclass
class Sample:
    """One request: when it was sent (s from the phase start), its latency, its outcome."""

    sent: float
    latency: float
    prompt: int
    status: int
    cache: str


def zipf_sequence(n: int, distinct: int, exponent: float, seed: int) -> list[int]:
    weights = list(accumulate(1 / (r ** exponent) for r in range(1, distinct + 1)))
    return random.Random(seed).choices(range(distinct), cum_weights=weights, k=n)


async def phase(url: str, model: str, prompts: list[str], sequence: list[int], rate: float,
                max_tokens: int) -> list[Sample]:
    """Send sequence open-loop at a fixed rate; wait for every answer (bounded)."""
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(i: int, prompt: int, start: float) -> None:
            body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": prompts[prompt]}]}
            sent = time.monotonic()
            try:
                async with session.post(url, json=body) as resp:
                    await resp.read()
                    status, cache = resp.status, resp.headers.get("X-Cache", "-").split(";")[0]
            except (aiohttp.ClientError, TimeoutError):
                status, cache = 0, "ERROR"
            samples.append(Sample(round(sent - start, 4), time.monotonic() - sent, prompt,
                                  status, cache))

        start = time.monotonic()
        tasks = []
        for i, prompt in enumerate(sequence):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(i, prompt, start)))
        await asyncio.gather(*tasks)
    return sorted(samples, key=lambda s: s.sent)


def saved_seconds(samples: list[Sample]) -> float:
    miss = {s.prompt: s.latency for s in samples if s.cache == "MISS"}
    return sum(miss.get(s.prompt, 0.0) for s in samples if s.cache in ("HIT", "COALESCED"))


def buckets(samples: list[Sample], width: float) -> list[list[Sample]]:
    out: list[list[Sample]] = []
    for s in samples:
        k = int(s.sent // width)
        while len(out) <= k:
            out.append([])
        out[k].append(s)
    return out


Phase = tuple[str, list[Sample]]
"""A phase's name and its samples (the direct one first)."""


def summary(phases: list[Phase], args: argparse.Namespace) -> str:
    rows = []
    direct_p99 = None
    for name, xs in phases:
        lat = [s.latency * 1000 for s in xs if s.status == 200]
        p99 = pct(lat, 0.99)
        direct_p99 = p99 if direct_p99 is None else direct_p99
        rows.append([name, len(xs), sum(1 for s in xs if s.status == 200),
                     f"{pct(lat, 0.5):.1f}", f"{p99:.1f}", f"{p99 / direct_p99:.2f}",
                     f"{sum(lat) / 1000:.1f}"])
    head = (f"Zipf s={args.exponent} over {args.distinct} prompts, {args.rate:g} req/s "
            f"open-loop for {args.duration:g} s per phase, greedy, max_tokens "
            f"{args.max_tokens}; proxy store memory://\n\n")
    lat_table = table(["path", "requests", "200 OK", "p50 ms", "p99 ms", "p99 / direct",
                       "sum of latencies s"], rows, "l")
    cache_rows = []
    for name, proxy in phases[1:]:
        caches = Counter(s.cache for s in proxy)
        served = len(proxy)
        hits = caches["HIT"] + caches["COALESCED"]
        last = buckets(proxy, args.bucket)[-1] if proxy else []
        last_rate = (sum(1 for s in last if s.cache in ("HIT", "COALESCED")) / len(last)
                     if last else float("nan"))
        cache_rows.append([
            name, caches["HIT"], caches["MISS"], caches["COALESCED"],
            served - caches["HIT"] - caches["MISS"] - caches["COALESCED"],
            f"{hits / served:.3f}" if served else "-", f"{last_rate:.3f}",
            f"{saved_seconds(proxy):.1f}"])
    cache_table = table(
        ["path", "X-Cache HIT", "MISS", "COALESCED (generations avoided by single-flight)",
         "other", "hit rate (HIT+COALESCED)", f"hit rate, last {args.bucket:g} s",
         "generation seconds saved"], cache_rows, "l")
    return head + lat_table + "\n\n" + cache_table


def plot(phases: list[Phase], args: argparse.Namespace) -> Path:
    fig, axes = figure(1, 2, (12, 4))
    hit_ax, lat_ax = axes[0]
    w = args.bucket
    for name, proxy in phases[1:]:
        pb = buckets(proxy, w)
        xs = [(k + 0.5) * w for k in range(len(pb))]
        hit_ax.plot(xs, [sum(1 for s in b if s.cache in ("HIT", "COALESCED")) / len(b)
                         if b else 0 for b in pb], label=f"{name}: HIT + COALESCED")
    hit_ax.set_ylim(0, 1)
    hit_ax.set_xlabel("seconds")
    hit_ax.set_ylabel(f"fraction of requests ({w:g} s buckets)")
    hit_ax.set_title(f"cacheproxy hit rate (Zipf s={args.exponent}, {args.distinct} prompts)")
    hit_ax.legend(fontsize=8)
    for name, samples in phases:
        bs = buckets(samples, w)
        bx = [(k + 0.5) * w for k in range(len(bs))]
        for p, style in ((0.5, "-"), (0.99, ":")):
            lat_ax.plot(bx, [pct([s.latency * 1000 for s in b], p) for b in bs], style,
                        label=f"{name} p{round(p * 100)}")
    lat_ax.set_yscale("log")
    lat_ax.set_xlabel("seconds")
    lat_ax.set_ylabel("latency ms")
    lat_ax.set_title(f"latency at {args.rate:g} req/s")
    lat_ax.legend(fontsize=8)
    return save(fig, args.out / "workload.png")


def main(args: argparse.Namespace) -> int:
    print(f"runtime: {runtime_line()}", file=sys.stderr)
    prompts = animal_prompts(args.distinct)
    sequence = zipf_sequence(round(args.rate * args.duration), args.distinct, args.exponent,
                             args.seed)
    with tempfile.TemporaryDirectory(prefix="lt_work_") as tmp, children() as procs:
        work = Path(tmp)
        model_dir = demo_model(work)
        upstream = start_upstream(procs, work, model_dir)
        proxy = start_proxy(procs, work, "--upstream", upstream.url, "--model-dir",
                            str(model_dir), "--model-id", "demo", "--store", "memory://",
                            "--queue-size", "4096")
        print(f"direct phase: {len(sequence)} requests", file=sys.stderr, flush=True)
        phases: list[Phase] = [("direct to mlx_lm.server", asyncio.run(phase(
            upstream.url + PATH, "default_model", prompts, sequence, args.rate,
            args.max_tokens)))]
        print("proxy phase (upstream)", file=sys.stderr, flush=True)
        phases.append(("through cacheproxy (upstream)", asyncio.run(phase(
            proxy.url + PATH, "demo", prompts, sequence, args.rate, args.max_tokens))))
        for slots in args.decode_slots:
            proxy = start_proxy(procs, work, "--model", str(model_dir), "--model-id", "demo",
                                "--store", "memory://", "--queue-size", "4096",
                                "--decode-slots", str(slots))
            print(f"proxy phase (in-process, S = {slots})", file=sys.stderr, flush=True)
            phases.append((f"through cacheproxy (in-process, S = {slots})", asyncio.run(
                phase(proxy.url + PATH, "demo", prompts, sequence, args.rate,
                      args.max_tokens))))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "workload.json").write_text(json.dumps(
        {"runtime": runtime_line(), "args": {k: str(v) for k, v in vars(args).items()},
         "phases": {name: [asdict(s) for s in samples] for name, samples in phases}}))
    plot(phases, args)
    print(summary(phases, args))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--distinct", type=int, default=3000, help="distinct prompts")
    p.add_argument("--exponent", type=float, default=1.1, help="Zipf exponent s")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--duration", type=float, default=120.0, help="seconds per phase")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--bucket", type=float, default=10.0, help="seconds per plotted bucket")
    p.add_argument("--seed", type=int, default=7, help="seed of the prompt sequence")
    p.add_argument("--decode-slots", type=int, action="append", default=[], metavar="S",
                   help="also through an in-process runner at --decode-slots S (repeatable)")
    p.add_argument("--smoke", action="store_true", help="3 s per phase, 10 req/s")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.smoke:
        args.distinct, args.rate, args.duration, args.bucket = 50, 10.0, 3.0, 1.0
    if args.rate <= 0 or args.duration <= 0 or args.distinct < 1 or \
            any(s < 1 for s in args.decode_slots):
        p.error("--rate, --duration, --distinct and --decode-slots must be positive")
    return args


if __name__ == "__main__":
    sys.exit(run(main, parse_args(), "workload"))
