"""A rolling upgrade on one Redis: two `cacheproxy serve` replicas of different engine versions.

An experiment, not a test (tests/e2e/test_invalidation.py has the in-process version). Two real
`cacheproxy serve` processes share a private redis-server; the "old" one runs with its
mlx-lm version reported as 0.0.1 (the version source injected at start, as the tests inject
it; its weights and code are the same, so only its fingerprint differs), the "new" one with
the installed version. For --seconds a client alternates the same questions between them:

  expect   each replica: one MISS per question, then only HITs, from its own namespace;
           both namespaces "current" with one live replica each and none purged throughout
  then     the old replica is stopped (SIGTERM: it releases its lease) and the new one keeps
           serving: the old namespace is superseded and purged no sooner than
           --supersede-grace after the stop, and within a lease renewal after that

    python loadtests/rolling_upgrade.py                  # a minute side by side (~2.5 min)
    python loadtests/rolling_upgrade.py --smoke --out /tmp/r

Prints a Markdown table and writes rolling_upgrade.png (requests over time, by replica and
X-Cache) and .json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from common import (
    HOST,
    RESULTS,
    BenchError,
    Procs,
    Server,
    animal_prompts,
    children,
    demo_model,
    figure,
    free_port,
    health_probe,
    run,
    runtime_line,
    save,
    start_redis,
    table,
)

# The old replica: the same code with mlx-lm's version read as 0.0.1 (another engine version).
OLD_ENGINE = """
import sys
import cacheproxy.keys.fingerprint as fingerprint
real = fingerprint.package_version
fingerprint.package_version = lambda name: "0.0.1" if name == "mlx-lm" else real(name)
from cacheproxy.cli.main import main
main(sys.argv[1:])
"""


def replica(procs: Procs, work: Path, name: str, store: str, model: Path,
            args: argparse.Namespace) -> Server:
    """`cacheproxy serve` on the shared store; the old one through OLD_ENGINE."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    head = [sys.executable, "-c", OLD_ENGINE] if name == "old" else \
        [sys.executable, "-m", "cacheproxy"]
    argv = [*head, "serve", "--host", HOST, "--port", str(port), "--no-watch", "--store",
            store, "--model", str(model), "--lease-ttl", str(args.lease_ttl),
            "--supersede-grace", str(args.grace), "--log-level", "warning"]
    return procs.launch(name, argv, url, work / f"{name}.log", health_probe(url))


async def health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/health") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def namespaces(store: str) -> dict[str, dict[str, Any]]:
    """The registry's view: state, live replicas and entries per namespace."""
    from backends import open_backend
    from cacheproxy.service.namespaces import Registry

    backend = open_backend(store)
    try:
        return {r.namespace.digest: {"state": r.namespace.state, "replicas": r.replicas,
                                     "entries": r.entries}
                for r in await Registry(backend).report()}
    finally:
        await backend.aclose()


async def side_by_side(servers: dict[str, Server], store: str, args: argparse.Namespace
                       ) -> dict[str, Any]:
    """Alternate the questions between the replicas for --seconds; what each answered."""
    questions = animal_prompts(args.questions)
    seen: dict[str, list[tuple[float, str, str]]] = {name: [] for name in servers}
    failures, checks = 0, []
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:
        i = 0
        while time.monotonic() - t0 < args.seconds:
            for name, server in servers.items():
                body = {"messages": [{"role": "user", "content": questions[i % len(questions)]}],
                        "max_tokens": 16}
                async with session.post(server.url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    if r.status != 200:
                        failures += 1
                        continue
                    seen[name].append((time.monotonic() - t0, r.headers["X-Cache"],
                                       r.headers["X-Cache-Fingerprint"]))
            i += 1
            if i % len(questions) == 0:  # once per round: the registry as it stands
                checks.append(await namespaces(store))
            await asyncio.sleep(args.pause)
        purged = {name: (await health(session, s.url))["counters"]["namespaces_purged"]
                  for name, s in servers.items()}
    return {"seen": seen, "failures": failures, "checks": checks, "purged": purged}


async def after_stop(servers: dict[str, Server], store: str, old_digest: str,
                     args: argparse.Namespace) -> dict[str, Any]:
    """Stop the old replica; how long until its namespace is superseded and emptied, while the
    new one keeps answering."""
    stopped = time.monotonic()
    old = servers["old"].proc
    os.killpg(old.pid, signal.SIGTERM)  # (not waited for here: its stop is timed below)
    gone_after, exited_after, hits, misses = None, None, 0, 0
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - stopped < args.grace + 4 * args.lease_ttl + 10:
            body = {"messages": [{"role": "user", "content": animal_prompts(1)[0]}],
                    "max_tokens": 16}
            async with session.post(servers["new"].url + "/v1/chat/completions",
                                    json=body) as r:
                await r.read()
                hits += r.headers.get("X-Cache") == "HIT"
                misses += r.headers.get("X-Cache") != "HIT"
            if exited_after is None and old.poll() is not None:
                exited_after = time.monotonic() - stopped
            ns = (await namespaces(store)).get(old_digest, {})
            if ns.get("state") == "superseded" and ns.get("entries") == 0:
                gone_after = time.monotonic() - stopped
                break
            await asyncio.sleep(0.05)
    if exited_after is None:  # aiohttp's graceful stop waits for requests up to 60 s
        await asyncio.get_running_loop().run_in_executor(None, old.wait, 60)
        exited_after = time.monotonic() - stopped
    return {"gone_after_s": gone_after, "old_stopped_after_s": round(exited_after, 2),
            "new_hits": hits, "new_not_hits": misses}


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with children() as procs:
        work = out / "work"
        work.mkdir(exist_ok=True)
        model = demo_model(work)
        store = f"{start_redis(procs, work).url}/0"
        servers = {name: replica(procs, work, name, store, model, args) for name in ("old", "new")}
        during = asyncio.run(side_by_side(servers, store, args))
        digests = {name: {fp for _, _, fp in rows} for name, rows in during["seen"].items()}
        if any(len(d) != 1 for d in digests.values()) or digests["old"] == digests["new"]:
            raise BenchError(f"expected one fingerprint per replica, two in all: {digests}")
        old_digest = next(iter(digests["old"]))
        after = asyncio.run(after_stop(servers, store, old_digest, args))
    rows, ok = [], True
    for name, seen in during["seen"].items():
        caches = [c for _, c, _ in seen]
        first_pass = min(args.questions, len(caches))
        misses_first = caches[:first_pass].count("MISS")
        hits_after = caches[first_pass:].count("HIT")
        ok &= misses_first == first_pass and hits_after == len(caches) - first_pass
        rows.append([name, len(caches), misses_first, hits_after,
                     len(caches) - first_pass - hits_after, during["purged"][name]])
    states = [{d: (v["state"], v["replicas"]) for d, v in check.items()} for check in
              during["checks"]]
    both_live = bool(states) and all(
        all(s == ("current", 1) for s in check.values()) and len(check) == 2 for check in states)
    gone = after["gone_after_s"]
    ok &= both_live and during["failures"] == 0 and not any(during["purged"].values())
    # Superseded no sooner than the grace after the stop, and within a renewal of the new
    # replica after the grace that started when the old one left (its stop is timed apart:
    # aiohttp's graceful stop may wait for requests in progress).
    left = after["old_stopped_after_s"]
    ok &= gone is not None and args.grace <= gone <= left + args.grace + args.lease_ttl + 5
    print(runtime_line())
    print(f"{args.seconds:.0f} s side by side, lease {args.lease_ttl} s, grace {args.grace} s, "
          f"{args.questions} questions alternated\n")
    print(table(["replica", "answers", "MISS in first round", "HIT after", "other after",
                 "namespaces purged"], rows))
    print(f"\nregistry checked {len(states)} times while both ran: both namespaces current "
          f"with one live replica each every time: {both_live}; failed requests: "
          f"{during['failures']}")
    print(f"old replica stopped (exited {after['old_stopped_after_s']} s after SIGTERM): its "
          f"namespace superseded and empty after "
          f"{gone if gone is None else round(gone, 2)} s (grace {args.grace} s); the new "
          f"replica meanwhile {after['new_hits']} HIT, {after['new_not_hits']} not")
    print(f"result: {'as expected' if ok else 'NOT as expected'}")
    fig, axes = figure()
    ax = axes[0][0]
    for y, (name, seen) in enumerate(during["seen"].items()):
        for cache, colour in (("MISS", "tab:red"), ("HIT", "tab:green")):
            ts = [t for t, c, _ in seen if c == cache]
            ax.scatter(ts, [y] * len(ts), s=6, c=colour, label=f"{name} {cache}")
    ax.set_yticks([0, 1], list(during["seen"]))
    ax.set_xlabel("seconds")
    ax.set_title("two engine versions on one Redis: answers by replica")
    ax.legend(loc="upper right", fontsize=7)
    save(fig, out / "rolling_upgrade.png")
    result = {"rows": rows, "both_live": both_live, "failures": during["failures"],
              "gone_after_s": gone, "args": vars(args), "ok": ok, **after}
    (out / "rolling_upgrade.json").write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--lease-ttl", type=float, default=30.0,
                        help="serve's --lease-ttl (its default)")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="serve's --supersede-grace (its default)")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--pause", type=float, default=0.05)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--smoke", action="store_true", help="3 s side by side, short leases")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.lease_ttl, args.grace, args.questions = 3.0, 0.6, 2.0, 4
    return args


if __name__ == "__main__":
    sys.exit(run(main, parse(), "rolling_upgrade"))
