"""Cache-HIT throughput of cacheproxy on every store, as a ratio to a bare aiohttp responder.

An experiment, not a test; a sweep over bench_hit.py (which does the measuring). For each
store (memory, disk, Redis, tiered over Redis) and for non-stream and stream, bench_hit starts
`cacheproxy serve --store <store>` (log level info, the default) and a bare aiohttp responder
answering the same HIT bytes, primes and verifies a HIT, then drives both with wrk (one
thread) at concurrency 1, 16 and 64: servers pinned to core 0, wrk to core 1. The ceiling is
measured in the same run as each store, in 3 rounds per point, each on fresh server
processes (bare and cacheproxy in turn, the order alternating); the ratio reported is the
round with the median ratio. A private
redis-server (no persistence) runs on the server core for the Redis and tiered stores.

    python loadtests/hit_path.py                       # ~10 min: 3 rounds of 2 s (+1 s warm-up)
    python loadtests/hit_path.py --stores memory,redis --duration 10
    python loadtests/hit_path.py --smoke --out /tmp/h  # tiered only, concurrency 1, 1 s

Targets (ratio to the ceiling): memory >= 0.80, tiered >= 0.80, Redis >= 0.60.
Prints a Markdown table and writes hit_path.png (and .json) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench_hit
from common import (
    RESULTS,
    SERVER_CORE,
    cacheproxy_cmd,
    children,
    figure,
    run,
    runtime_line,
    save,
    start_redis,
    table,
)

STORES = ("memory", "disk", "redis", "tiered")
TARGETS = {"memory": 0.80, "tiered": 0.80, "redis": 0.60}


def store_url(store: str, work: Path, redis_url: str | None) -> str:
    if store == "memory":
        return "memory://"
    if store == "disk":
        return f"disk://{work / 'disk-store'}"
    if store == "redis":
        return f"{redis_url}/0"
    if store == "tiered":
        return f"tiered+{redis_url}/1"
    raise ValueError(store)


def bench_args(args: argparse.Namespace, store: str, stream: bool) -> argparse.Namespace:
    return argparse.Namespace(
        store=store, stream=stream, models=1, duration=args.duration, warmup=args.warmup,
        rounds=args.rounds, concurrency=args.concurrency, load="auto", log_level="info",
        pin=args.pin, cacheproxy=cacheproxy_cmd())


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lt_hit_") as tmp, children() as procs:
        work = Path(tmp)
        needs_redis = {"redis", "tiered"} & set(args.stores)
        redis_url = None
        if needs_redis:
            redis_url = start_redis(procs, work, core=SERVER_CORE if args.pin else None).url
        for store in args.stores:
            for stream in args.streams:
                if store == "disk":
                    shutil.rmtree(work / "disk-store", ignore_errors=True)
                url = store_url(store, work, redis_url)
                print(f"{store} ({url}) {'stream' if stream else 'non-stream'}",
                      file=sys.stderr, flush=True)
                result = bench_hit.measure(bench_args(args, url, stream))
                runs.append({**result, "store": store, "store_url": result["store"]})
    return runs


def verdict(store: str, ratio: float | None) -> str:
    target = TARGETS.get(store)
    if target is None or ratio is None:
        return "-"
    return f"{'ok' if ratio >= target else 'BELOW'} (>= {target:.2f})"


def markdown(runs: list[dict[str, Any]]) -> str:
    rows = []
    for r in runs:
        for row in r["rows"]:
            b, c = row["bare"], row["cacheproxy"]
            rows.append([r["store"], "stream" if r["stream"] else "non-stream",
                         row["concurrency"], f"{b['rps']:.0f}", f"{c['rps']:.0f}",
                         f"{row['ratio']:.2f}",
                         " ".join(f"{x:.2f}" for x in row["round_ratios"]),
                         f"{b['p50_ms']:.2f} / {b['p99_ms']:.2f}",
                         f"{c['p50_ms']:.2f} / {c['p99_ms']:.2f}",
                         f"{b['cpu_us_per_req']} / {c['cpu_us_per_req']}",
                         verdict(r["store"], row["ratio"]), b["errors"] + c["errors"]])
    first = runs[0]
    pin = first["pinned"]
    head = (f"load generator: {first['load_generator']} (1 thread); "
            f"{first['rounds']} rounds per point, bare and cacheproxy in turn, each "
            f"{first['duration_s']:g} s after {first['warmup_s']:g} s warm-up; ratio = the "
            "round with the median ratio; "
            + (f"servers (and redis-server) on core {pin['servers']}, wrk on core {pin['load']}"
               if pin else "not pinned") + "; ceiling = bare aiohttp responder, same run\n\n")
    return head + table(
        ["store", "mode", "conc.", "ceiling rps", "cacheproxy rps", "ratio", "round ratios",
         "ceiling p50 / p99 ms", "cacheproxy p50 / p99 ms", "server CPU µs/req ceiling / proxy",
         "target", "errors"], rows, "ll")


def plot(runs: list[dict[str, Any]], args: argparse.Namespace) -> Path:
    fig, axes = figure(1, len(args.streams), (6 * len(args.streams), 4))
    for ax, stream in zip(axes[0], args.streams, strict=True):
        chosen = [r for r in runs if r["stream"] == stream]
        width = 0.8 / max(1, len(chosen))
        for k, r in enumerate(chosen):
            xs = [i + k * width for i in range(len(r["rows"]))]
            ax.bar(xs, [row["ratio"] for row in r["rows"]], width, label=r["store"])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(args.concurrency))],
                      [f"c={c}" for c in args.concurrency])
        for target in sorted(set(TARGETS.values())):
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylim(0, 1.2)
        ax.set_ylabel("cacheproxy rps / bare responder rps")
        ax.set_title("stream" if stream else "non-stream")
        ax.legend(fontsize=8)
    return save(fig, args.out / "hit_path.png")


def main(args: argparse.Namespace) -> int:
    print(f"runtime: {runtime_line()}", file=sys.stderr)
    runs = sweep(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hit_path.json").write_text(json.dumps(
        {"runtime": runtime_line(), "runs": runs}, indent=1))
    plot(runs, args)
    print(markdown(runs))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default=",".join(STORES), help="comma-separated: " +
                   ", ".join(STORES))
    p.add_argument("--duration", type=float, default=2.0,
                   help="seconds per target and round")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per target and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per point (median ratio)")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="non-stream only")
    p.add_argument("--no-pin", dest="pin", action="store_false")
    p.add_argument("--smoke", action="store_true", help="tiered store only, c=1, 1 s")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.smoke:
        args.stores, args.concurrency, args.duration, args.warmup, args.rounds = \
            "tiered", "1", 1, 0, 1
    bench_hit.check_timing(p, args)
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not set(args.stores) <= set(STORES):
        p.error(f"--stores: choose from {', '.join(STORES)}")
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    args.streams = [False, True] if args.stream else [False]
    args.pin = args.pin and (os.cpu_count() or 1) >= 2
    return args


if __name__ == "__main__":
    sys.exit(run(main, parse_args(), "hit_path"))
