"""How soon another replica stops serving an entry deleted elsewhere (tiered store on Redis).

Two `cacheproxy serve` processes share one private redis-server through `tiered+redis://`,
with an L1 life of an hour, so only Redis's invalidation (client-side caching) can make a
replica's L1 let go of a copy. Each round: a new prompt is answered by replica A (MISS), then
twice by B (HIT read from Redis, then HIT from B's L1); the entry is deleted through A's admin
API; then B is asked again, back to back, until it stops answering HIT. Reported: how many
stale HITs B served after the delete had been acknowledged, and the time from that
acknowledgement to sending the first request B did not answer from its copy.

Baseline, in the same run: the same two replicas on a Redis user without the CLIENT command
(the server refuses tracking), with an L1 life of 2 s: what a tiered store that cannot track
does (over disk), where only l1_ttl ends a stale copy.

    python loadtests/coherence.py                      # 100 rounds, baseline 5
    python loadtests/coherence.py --smoke --out /tmp/c # 5 rounds, baseline 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    BenchError,
    children,
    figure,
    http,
    pct,
    run,
    runtime_line,
    save,
    start_proxy,
    start_redis,
    table,
)

TOKEN = "coherence-bench"
GIVE_UP_S = 5.0
BASELINE_L1_TTL = 2


@dataclass
class Round:
    stale_hits: int  # HITs B served after the delete was acknowledged
    ms_to_drop: float  # from the acknowledgement to sending B's first non-HIT request


def ask(url: str, prompt: str) -> tuple[str, str]:
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    status, headers, _ = http("POST", url + "/v1/completions", body)
    if status != 200:
        raise BenchError(f"{url} answered {status}")
    return headers["X-Cache"], headers["X-Cache-Key"]


def delete(url: str, key: str) -> None:
    req = urllib.request.Request(f"{url}/admin/entries/{key}", method="DELETE",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        if resp.status != 200:
            raise BenchError(f"delete answered {resp.status}")


def one_round(a: str, b: str, prompt: str) -> Round:
    status, key = ask(a, prompt)
    seen = [status, ask(b, prompt)[0], ask(b, prompt)[0]]
    if seen != ["MISS", "HIT", "HIT"]:
        raise BenchError(f"expected MISS, HIT, HIT before the delete, got {seen}")
    delete(a, key)
    acknowledged = time.monotonic()
    stale = 0
    while True:
        sent = time.monotonic()
        if sent - acknowledged > GIVE_UP_S:
            raise BenchError(f"replica B still served the deleted entry after {GIVE_UP_S} s")
        if ask(b, prompt)[0] != "HIT":
            return Round(stale, round((sent - acknowledged) * 1000, 3))
        stale += 1


def main(args: argparse.Namespace) -> int:
    print(f"runtime: {runtime_line()}", file=sys.stderr)
    os.environ["CACHEPROXY_ADMIN_TOKEN"] = TOKEN  # inherited by both replicas
    results: dict[str, list[Round]] = {}
    with tempfile.TemporaryDirectory(prefix="lt_coherence_") as tmp, children() as procs:
        work = Path(tmp)
        redis = start_redis(procs, work)
        with redis_client(redis.url) as client:  # a user the server will not track for
            client.acl_setuser("untracked", enabled=True, passwords=["+pw"], keys=["*"],
                               channels=["*"], commands=["+@all", "-client"])
        host = redis.url.removeprefix("redis://")
        stores = {
            "tiered+redis, l1_ttl 3600 s": (f"tiered+{redis.url}/0?l1_ttl=3600", args.rounds),
            f"untracked baseline, l1_ttl {BASELINE_L1_TTL} s":
                (f"tiered+redis://untracked:pw@{host}/0?l1_ttl={BASELINE_L1_TTL}",
                 args.baseline_rounds),
        }
        for n, (name, (store, count)) in enumerate(stores.items()):
            if count == 0:  # (--baseline-rounds 0: no baseline)
                continue
            a = start_proxy(procs, work, "--store", store, log_level="warning").url
            b = start_proxy(procs, work, "--store", store, log_level="warning").url
            results[name] = [one_round(a, b, f"The heron number {i} of {n} and the")
                             for i in range(count)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "coherence.json").write_text(json.dumps(
        {"runtime": runtime_line(),
         "stores": {name: [asdict(r) for r in rounds] for name, rounds in results.items()}},
        indent=1))
    plot(results, args.out)
    print(markdown(results))
    return 0


def redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


def markdown(results: dict[str, list[Round]]) -> str:
    rows = []
    for name, rounds in results.items():
        ms = [r.ms_to_drop for r in rounds]
        stale = [r.stale_hits for r in rounds]
        rows.append([name, len(rounds), sum(stale), max(stale), f"{statistics.median(ms):.2f}",
                     f"{pct(ms, 0.99):.2f}", f"{max(ms):.2f}"])
    return table(["store", "rounds", "stale HITs after the delete (total)", "max in a round",
                  "ms to B's first non-HIT p50", "p99", "max"], rows, align="l")


def plot(results: dict[str, list[Round]], out: Path) -> Path:
    fig, axes = figure(size=(8, 3.5))
    ax = axes[0][0]
    names = list(results)
    ax.boxplot([[r.ms_to_drop for r in results[n]] for n in names], vert=False)
    ax.set_yticks(range(1, len(names) + 1), names)
    ax.set_xlabel("ms from the delete's acknowledgement to replica B's first non-HIT request")
    ax.set_title("Another replica's delete reaching this replica's L1")
    return save(fig, out / "coherence.png")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--baseline-rounds", type=int, default=5,
                   help="rounds of the untracked baseline (0: none)")
    p.add_argument("--smoke", action="store_true", help="5 rounds, baseline 1")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the PNG and JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.baseline_rounds = 5, 1
    if args.rounds < 1 or args.baseline_rounds < 0:
        p.error("--rounds >= 1 and --baseline-rounds >= 0")
    return args


if __name__ == "__main__":
    sys.exit(run(main, parse_args(), "coherence"))
