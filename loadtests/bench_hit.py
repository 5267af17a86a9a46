"""Cache-HIT throughput of `cacheproxy serve` next to a bare aiohttp responder.

A benchmark, not a test. It starts, on 127.0.0.1 only:
  * `cacheproxy serve --store memory://` (or the --store given) on a free port;
    primes one entry (MISS) and checks the next identical request is `X-Cache: HIT`;
  * a bare aiohttp app on uvloop (this file, `--_bare` mode) that answers
    POST /v1/chat/completions with the very bytes of that HIT body (or, with
    --stream, the HIT's SSE bytes), no logging.
Then drives both with wrk (POST, one thread; connections 1, 16, 64), servers pinned to
core 0 and wrk to core 1 when the machine has two cores or more, and prints a Markdown
table (or --json). Falls back to a Python aiohttp load loop only when wrk is missing.
It runs --rounds rounds, each on a fresh pair of server processes (one process of the same
code ran ~3 % faster or slower than the next: hash seeds, memory layout); in each round,
at each concurrency, bare and cacheproxy in turn (the order alternating by round). The
figure is the round with the median ratio, reported with every round's ratio: between
identical runs a single round's ratio moved by up to ±0.06 here.

    python loadtests/bench_hit.py                       # memory store, 3 rounds of 3 s
    python loadtests/bench_hit.py --store disk:///tmp/x --stream
    python loadtests/bench_hit.py --smoke --json        # concurrency 1, 1 s, no warm-up
    python loadtests/bench_hit.py --models 2            # two models, requests alternating

With --models 2, cacheproxy serves the demo model under two ids of one length (MODELS) and
wrk alternates the request between them, so every request is routed by the body's model.

The table also gives each server's CPU time (user + sys, from /proc) per request: on a
shared machine rps moves with other load, CPU per request much less. wrk durations are
whole seconds. Both servers are terminated on exit, on error and on Ctrl-C; every step has
a time bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The one process launcher, shared with the tests.
from tests.harness.processes import (  # noqa: E402
    HOST,
    HarnessError,
    Procs,
    free_port,
    http,
    pinned,
    wait_ready,
)

PATH = "/v1/chat/completions"
# --models 2: the demo model under both ids (names of one length: the HIT bodies are too).
MODELS = ("cacheproxy-demo", "cacheproxy-twin")
BODY: dict[str, Any] = {
    "model": MODELS[0],
    "messages": [{"role": "user", "content": "What does the fox eat?"}],
    "max_tokens": 32,
}
SERVER_CORE, LOAD_CORE = 0, 1

# wrk prints one JSON line from done(): the numbers we need, in microseconds.
WRK_LUA = """\
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
%(alternate)s
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%%d,"duration_us":%%d,"bytes":%%d,"p50_us":%%d,"p90_us":%%d,' ..
    '"p99_us":%%d,"max_us":%%d,"mean_us":%%f,"connect":%%d,"read":%%d,"write":%%d,' ..
    '"status":%%d,"timeout":%%d}\\n',
    summary.requests, summary.duration, summary.bytes,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


# More than one body: the requests are made once and sent in turn.
ALTERNATE_LUA = """\
local bodies, requests, sent = {%(bodies)s}, {}, 0
function init(args)
  for i, body in ipairs(bodies) do requests[i] = wrk.format(nil, nil, nil, body) end
end
function request()
  sent = sent + 1
  return requests[sent %% #requests + 1]
end
"""


def wrk_script(payloads: list[bytes]) -> str:
    """The wrk script that POSTs `payloads` (in turn when there are several)."""
    bodies = [json.dumps(p.decode()) for p in payloads]
    alternate = ALTERNATE_LUA % {"bodies": ", ".join(bodies)} if len(payloads) > 1 else ""
    return WRK_LUA % {"body": bodies[0], "alternate": alternate}


def payloads(stream: bool, models: int) -> list[bytes]:
    """The request bodies: one per served model."""
    body = dict(BODY, stream=True) if stream else BODY
    return [json.dumps({**body, "model": name}, separators=(",", ":")).encode()
            for name in MODELS[:models]]


def model_args(models: int) -> list[str]:
    """cacheproxy's --model options: none for the demo alone, else the demo under each id."""
    if models <= 1:
        return []
    from cacheproxy.runners.demo.model import BUNDLED_MODEL
    return [arg for name in MODELS[:models] for arg in ("--model", f"{name}={BUNDLED_MODEL}")]


BenchError = HarnessError  # (one error for the process machinery tests and load tests share)


@dataclass
class Point:
    """One measured (target, concurrency) point."""

    target: str
    concurrency: int
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us_per_req: float | None = None  # server CPU (user+sys, all threads) per request


# -- bare responder (runs as its own process) ------------------------------------------


def serve_bare(port: int, body_file: str, stream: bool) -> None:
    """A minimal aiohttp app on uvloop answering POST /v1/chat/completions with fixed bytes."""
    import uvloop
    from aiohttp import web

    payload = Path(body_file).read_bytes()

    async def whole(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(body=payload, content_type="application/json")

    async def sse(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(payload)
        await response.write_eof()
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_post(PATH, sse if stream else whole)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, HOST, port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    uvloop.run(main())


# -- processes ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads), from /proc; None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- load generators ---------------------------------------------------------------------


def run_wrk(wrk: str, url: str, script: Path, conns: int, seconds: float, core: int | None
            ) -> dict[str, Any]:
    argv = pinned([wrk, "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency",
                   "--timeout", "10s", "-s", str(script), url], core)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30)
    for line in done.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return dict(json.loads(line[len("BENCH_JSON "):]))
    raise BenchError(f"wrk gave no result (exit {done.returncode}):\n{done.stdout}{done.stderr}")


def wrk_point(name: str, result: dict[str, Any], conns: int) -> Point:
    seconds = result["duration_us"] / 1e6
    errors = sum(result[k] for k in ("connect", "read", "write", "status", "timeout"))
    return Point(name, conns, result["requests"], round(seconds, 3),
                 round(result["requests"] / seconds, 1),
                 round(result["p50_us"] / 1000, 3), round(result["p99_us"] / 1000, 3), errors)


async def _python_load(url: str, payload: bytes, conns: int, seconds: float) -> Point:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=payload,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        continue
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)

    connector = aiohttp.TCPConnector(limit=conns)
    timeout = aiohttp.ClientTimeout(total=10)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(conns)))
    elapsed = time.monotonic() - started
    latencies.sort()

    def pct(p: float) -> float:
        if not latencies:
            return float("nan")
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000, 3)

    return Point("", conns, len(latencies), round(elapsed, 3),
                 round(len(latencies) / elapsed, 1), pct(0.50), pct(0.99), errors)


def run_python(url: str, payload: bytes, conns: int, seconds: float) -> Point:
    return asyncio.run(asyncio.wait_for(_python_load(url, payload, conns, seconds),
                                        seconds + 30))


# -- the benchmark -----------------------------------------------------------------------


@contextlib.contextmanager
def servers(args: argparse.Namespace, work: Path, bodies: list[bytes]
            ) -> Iterator[tuple[dict[str, tuple[str, int]], dict[str, Any]]]:
    """Start cacheproxy, prime and verify a HIT of each body, start the bare responder.

    Yields {"bare": (url, pid), "cacheproxy": (url, pid)} and facts about the HIT.
    """
    procs = Procs()
    core = SERVER_CORE if args.pin else None
    try:
        cp_port = free_port()
        cp_log = work / "cacheproxy.log"
        cp = procs.start("cacheproxy", [*args.cacheproxy, "serve", "--host", HOST,
                                        "--port", str(cp_port), "--store", args.store,
                                        "--log-level", args.log_level,
                                        *model_args(args.models)], cp_log, core)
        base = f"http://{HOST}:{cp_port}"
        wait_ready(cp, lambda: http("GET", base + "/health", timeout=2)[0] == 200, cp_log,
                   "cacheproxy")
        hits = [_prime(base + PATH, body) for body in bodies]
        first, (headers, hit_body) = hits[0][0], hits[0][1:]
        cache = headers.get("X-Cache", "")
        if len({len(hit[2]) for hit in hits}) != 1:
            raise BenchError("the HIT bodies of the models differ in length")
        payload = bodies[0]
        hit_file = work / "hit_body"
        hit_file.write_bytes(hit_body)

        bare_port = free_port()
        bare_log = work / "bare.log"
        bare_argv = [sys.executable, str(Path(__file__).resolve()), "--_bare", str(bare_port),
                     str(hit_file)] + (["--stream"] if args.stream else [])
        bare = procs.start("bare", bare_argv, bare_log, core)
        bare_url = f"http://{HOST}:{bare_port}{PATH}"
        wait_ready(bare, lambda: http("POST", bare_url, payload, timeout=2)[0] == 200, bare_log,
                   "bare responder")
        bare_body = http("POST", bare_url, payload)[2]
        if len(bare_body) != len(hit_body):
            raise BenchError(f"bare body is {len(bare_body)} bytes, the hit {len(hit_body)}")
        info = {"priming_x_cache": first[1].get("X-Cache", ""), "verify_x_cache": cache,
                "hit_body_bytes": len(hit_body),
                "hit_headers": {k: v for k, v in headers.items() if k.startswith("X-Cache")}}
        yield {"bare": (bare_url, bare.pid), "cacheproxy": (base + PATH, cp.pid)}, info
        # Still a HIT after the load (nothing was evicted or refilled meanwhile).
        for body in bodies:
            after = http("POST", base + PATH, body)[1].get("X-Cache", "")
            if not after.startswith("HIT"):
                raise BenchError(f"after the load the request is no longer a HIT: {after!r}")
    finally:
        procs.close()


def _prime(url: str, body: bytes) -> tuple[tuple[int, dict[str, str], bytes], dict[str, str],
                                          bytes]:
    """Store the answer to `body` (MISS) and check the next one is a HIT: (the priming
    response, the HIT's headers and body)."""
    first = http("POST", url, body)
    if first[0] != 200:
        raise BenchError(f"priming request answered {first[0]}: {first[2][:500]!r}")
    status, headers, hit_body = http("POST", url, body)
    cache = headers.get("X-Cache", "")
    if status != 200 or not cache.startswith("HIT"):
        raise BenchError(f"second request was not a HIT: {status} X-Cache={cache!r}")
    return first, headers, hit_body


def _round(args: argparse.Namespace, targets: dict[str, tuple[str, int]], conns: int,
           index: int, wrk: str | None, script: Path, payload: bytes, load_core: int | None
           ) -> tuple[Point, Point]:
    """One round at `conns`: bare and cacheproxy in turn (the order alternates by round)."""
    pair: dict[str, Point] = {}
    order = list(targets.items())
    for name, (url, pid) in order if index % 2 == 0 else reversed(order):
        if wrk:
            if args.warmup > 0:
                run_wrk(wrk, url, script, conns, args.warmup, load_core)
            cpu0 = cpu_seconds(pid) or 0.0
            point = wrk_point(name, run_wrk(wrk, url, script, conns, args.duration, load_core),
                              conns)
        else:
            if args.warmup > 0:
                run_python(url, payload, conns, args.warmup)
            cpu0 = cpu_seconds(pid) or 0.0
            point = run_python(url, payload, conns, args.duration)
            point.target = name
        cpu1 = cpu_seconds(pid)
        if cpu1 is not None and point.requests:
            point.cpu_us_per_req = round((cpu1 - cpu0) / point.requests * 1e6, 1)
        pair[name] = point
        print(f"  c={conns:<3} round {index + 1} {name:<10} {point.rps:>9.1f} rps  "
              f"p50 {point.p50_ms:.2f} ms  p99 {point.p99_ms:.2f} ms  "
              f"cpu {point.cpu_us_per_req} us/req  errors {point.errors}",
              file=sys.stderr, flush=True)
    return pair["bare"], pair["cacheproxy"]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    bodies = payloads(args.stream, args.models)
    payload = bodies[0]  # (the Python load loop sends this one only)
    wrk = None if args.load == "python" else shutil.which("wrk")
    if args.load == "wrk" and wrk is None:
        raise BenchError("--load wrk but wrk is not on PATH")
    generator = "wrk" if wrk else "python-aiohttp"
    why = "forced by --load python" if args.load == "python" else "wrk not found"
    print(f"load generator: {generator}"
          + ("" if wrk else f" ({why}; numbers are bounded by the Python client)"),
          file=sys.stderr, flush=True)
    load_core = LOAD_CORE if args.pin else None
    if not wrk and load_core is not None:
        os.sched_setaffinity(0, {load_core})

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_hit_") as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(wrk_script(bodies))
        # Each round runs on fresh server processes: the same code ran 3 % faster or slower
        # from one process to the next (hash seeds, memory layout), more than one round moves.
        by_conns: dict[int, list[tuple[Point, Point]]] = {c: [] for c in args.concurrency}
        for r in range(args.rounds):
            with servers(args, work, bodies) as (targets, info):
                for conns in args.concurrency:
                    by_conns[conns].append(
                        _round(args, targets, conns, r, wrk, script, payload, load_core))
        for conns, rounds in by_conns.items():
            ratios = [c.rps / b.rps if b.rps else 0.0 for b, c in rounds]
            # The round with the median ratio: drift and bursts of other load on the
            # machine hit one round, not the figure.
            b, c = rounds[sorted(range(len(rounds)), key=ratios.__getitem__)[len(rounds) // 2]]
            cpu_ratio = (round(b.cpu_us_per_req / c.cpu_us_per_req, 3)
                         if b.cpu_us_per_req and c.cpu_us_per_req else None)
            rows.append({"concurrency": conns, "bare": asdict(b), "cacheproxy": asdict(c),
                         "ratio": round(c.rps / b.rps, 3) if b.rps else None,
                         "cpu_ratio": cpu_ratio,
                         "round_ratios": [round(r, 3) for r in ratios]})
    return {
        "load_generator": generator, "store": args.store, "stream": args.stream,
        "models": args.models,
        "duration_s": args.duration, "warmup_s": args.warmup, "rounds": args.rounds,
        "threads": 1,
        "pinned": {"servers": SERVER_CORE, "load": LOAD_CORE} if args.pin else None,
        "cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        **info, "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    pin = result["pinned"]
    lines = [
        f"load generator: {result['load_generator']}; store {result['store']}; "
        f"{result['models']} model(s); "
        f"{'stream' if result['stream'] else 'non-stream'}; {result['duration_s']:g} s per point "
        f"(+{result['warmup_s']:g} s warm-up); hit body {result['hit_body_bytes']} B; "
        + (f"servers on core {pin['servers']}, load on core {pin['load']}" if pin
           else "not pinned")
        + f"; load average at the end {result['loadavg_1m_at_end']:g}",
        "CPU ratio = bare CPU/req over cacheproxy CPU/req: the throughput ratio when both are"
        " CPU-bound, and less disturbed than rps by other load on the machine.",
        "",
        "| concurrency | bare rps | cacheproxy rps | ratio | bare p50/p99 ms "
        "| cacheproxy p50/p99 ms | server CPU µs/req bare / cacheproxy (ratio) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        b, c = row["bare"], row["cacheproxy"]
        ratio = _num(row["ratio"])
        lines.append(f"| {row['concurrency']} | {b['rps']:.0f} | {c['rps']:.0f} | {ratio} "
                     f"| {b['p50_ms']:.2f} / {b['p99_ms']:.2f} "
                     f"| {c['p50_ms']:.2f} / {c['p99_ms']:.2f} "
                     f"| {_cpu(b)} / {_cpu(c)} ({_num(row['cpu_ratio'])}) |")
    errors = sum(r["bare"]["errors"] + r["cacheproxy"]["errors"] for r in result["rows"])
    if errors:
        lines.append(f"\nWARNING: {errors} request errors (socket errors or non-2xx)")
    return "\n".join(lines)


def _cpu(point: dict[str, Any]) -> str:
    return _num(point["cpu_us_per_req"], "{:.0f}")


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _default_cacheproxy() -> list[str]:
    exe = Path(sys.executable).with_name("cacheproxy")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "cacheproxy"]


def check_timing(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--duration, --warmup and --rounds as measure() needs them (hit_path.py shares it)."""
    if args.duration <= 0 or args.warmup < 0 or args.rounds < 1:
        p.error("--duration must be > 0, --warmup >= 0 and --rounds >= 1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="memory://", help="store URL passed to cacheproxy serve")
    p.add_argument("--stream", action="store_true", help="measure stream: true hits")
    p.add_argument("--models", type=int, choices=(1, 2), default=1,
                   help="models served (2: the requests alternate between them)")
    p.add_argument("--duration", type=float, default=3.0,
                   help="seconds per target and round (default 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per concurrency, bare and cacheproxy in turn; the figure is "
                   "the round with the median ratio (default 3)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per point")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated connections")
    p.add_argument("--smoke", action="store_true", help="concurrency 1, 1 s, no warm-up")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    p.add_argument("--load", choices=["auto", "wrk", "python"], default="auto",
                   help="load generator (auto: wrk when installed)")
    p.add_argument("--log-level", default="info",
                   help="cacheproxy's log level (default info: one JSON line per request, "
                        "as it serves by default)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin to cores")
    p.add_argument("--cacheproxy", nargs="+", default=None, metavar="ARG",
                   help="command that runs the cacheproxy CLI (default: the venv's);"
                   " give it last, it takes the remaining arguments")
    p.add_argument("--_bare", nargs=2, metavar=("PORT", "BODY_FILE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._bare:
        return args
    if args.smoke:
        args.concurrency, args.duration, args.warmup, args.rounds = "1", 1.0, 0.0, 1
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs positive integers")
    check_timing(p, args)
    args.cacheproxy = args.cacheproxy or _default_cacheproxy()
    args.pin = args.pin and (os.cpu_count() or 1) >= 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._bare:
        serve_bare(int(args._bare[0]), args._bare[1], args.stream)
        return 0
    # SIGINT (even if inherited as ignored) and SIGTERM unwind as KeyboardInterrupt, so the
    # servers are stopped by the finally blocks.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        result = measure(args)
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    except (BenchError, subprocess.TimeoutExpired, TimeoutError) as exc:
        print(f"bench_hit: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
