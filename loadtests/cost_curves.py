"""Cost curves: what a growing cache costs on the disk and the Redis store (issue #18, item 4).

An experiment, not a test. For each store (`disk:///dir` and `redis://127.0.0.1:PORT/0` on a
private redis-server, both opened through the project's own store factory,
`cacheproxy.service.cassette.open_store` -> `backends.open_backend`), one namespace is filled
with N entries for each N of --sizes (default 10k, 100k, 1M; the namespace grows from one size
to the next). The entries are what the proxy stores: a chat request parsed and keyed as the
proxy keys it (`keys.canonical.parse`, `keys.key.make_key`, under the demo model's
fingerprint), with an answer the demo model really generated and the provenance `fill.py`
writes, encoded by `keys.codec.encode` (~1.45 kB each, a third of it the fingerprint's
fields). The fill is concurrent `set()` calls (16 in flight; the stores have no batch API).
At each size:

- the hit path at the store: GETs of random existing keys, one at a time, through `get()`
  (p50 / p99 over --rounds rounds; client GC off while timing). Each round takes turns with a
  round on a second store of the same kind that holds the smallest size throughout (its own
  directory / redis-server): the ratio to it is measured in the same minutes, so what else
  runs on the machine weighs on both; at the smallest size it is an A/A check;
- the hit path over HTTP: a real `cacheproxy serve --store <same URL>` (demo model, log level
  warning), started after the fill, answering chat requests of random stored entries one at
  a time on a keep-alive connection (every answer must be a HIT); --no-http skips it;
- the store's size per entry: Redis INFO used_memory (`stats()`) above the empty server's,
  the disk directory's allocated bytes (du: database, WAL and shm files), and the stored key +
  value bytes per entry for reference;
- listing the namespace's keys (backends/listing.py, as `cacheproxy verify` and `export` do):
  one 1000-key page, the whole namespace, and what `verify --sample 100` reads;
- disk only: a get() right after another connection to the same database (another process:
  `cacheproxy purge`, a second replica) committed one write.

Then the purge: a second namespace gets 10k entries (--other), its hit p99 is measured, then
the big namespace is purged with `purge_namespace()` (what the admin API, `cacheproxy purge`
and the invalidator's background purge call) in the same process and event loop, as a
serving proxy would run it (the disk store has its batches done by a child process of its
own, backends/disk_purger.py), while the same GETs on the second namespace run; then once more
after the purge. Then the namespace is filled again and purged by `cacheproxy purge`'s own
code (cacheproxy/cli/store.py `purge`) in a child process, as an operator would, with the
same GETs (--no-cli-purge skips this). Each purge runs and pauses in turns of 0.1 s
(--purge-turns; paused between two of its steps, in this process or the child), and
the GETs while it runs are compared with those while it pauses, in the same seconds, as well
as with those before it: on a shared machine the load before may not be the load during.
The purge timelines in the JSON keep every k-th GET while the purge runs and the slowest (at
most 2000 a purge); the figures are of all. Last, `verify`
(cacheproxy/cli/verify.py) with an in-process MlxRunner on the demo model, over --verify
entries the demo model generated through an in-process proxy (build_app) into a fresh store
of each kind: entries per second.

    python loadtests/cost_curves.py                         # 10k, 100k, 1M entries (~30 min)
    python loadtests/cost_curves.py --sizes 10k,100k --stores redis
    python loadtests/cost_curves.py --smoke --out /tmp/cc   # 1k and 3k entries, 5 verified
    python loadtests/cost_curves.py --replot results/cost_curves.json --out /tmp/cc

Targets, ratios measured in the same run: hit p99 at the largest size <= 1.5x that at the
smallest (per store, at the store: between the sweep's two points, and against the small
store read in turns with it); hit p99 during a purge <= 2x without it (before it, and in its
pauses). A store whose
projected fill time exceeds --fill-budget stops at the largest size that fits (said in the
output; nothing is extrapolated). Prints Markdown tables and writes cost_curves.json and
cost_curves.png to --out; exits 1 when an optional part (HTTP, the second purge, verify)
failed, after writing what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import http.client
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    HOST,
    RESULTS,
    BenchError,
    Procs,
    animal_prompts,
    children,
    figure,
    free_port,
    pct,
    run,
    runtime_line,
    save,
    start_proxy,
    start_redis,
    table,
)

STORES = ("disk", "redis")
SIZES = (10_000, 100_000, 1_000_000)
SMOKE_SIZES = (1_000, 3_000)
P99_GROWTH_TARGET = 1.5  # hit p99 at the largest size / at the smallest
PURGE_TARGET = 2.0  # hit p99 during a purge / without one
FILL_IN_FLIGHT = 16
MAX_TOKENS = 48
DISK_MAX_BYTES = 1 << 36  # far above what the run stores: nothing is evicted
PAGE = 1000  # keys per listing page, as verify asks
SAMPLE = 100  # keys of `verify --sample`
SLOW_GET_US = 10_000  # a GET this slow during a purge counts as a stall


def parse_size(text: str) -> int:
    """10000, 10k, 1M, 1.5m -> entries."""
    text = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1, got {text!r}")
    return value


def label(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


def load_line() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# -- the entries ------------------------------------------------------------------------------


@dataclass
class Corpus:
    """Real records, as the proxy stores them, keyed under the demo model's fingerprint."""

    runner: Any  # the started MlxRunner
    answers: list[tuple[Any, float]] = field(default_factory=list)  # (Output, generation ms)

    async def generate_answers(self, count: int) -> None:
        """Answers the demo model really generates, to put in the records."""
        for prompt in animal_prompts(count):
            started = time.perf_counter()
            generation = self.runner.generate(self.request(prompt))
            async for _ in generation.chunks():
                pass
            if generation.output is None:
                raise BenchError("the demo model ended without output")
            self.answers.append((generation.output, (time.perf_counter() - started) * 1000))

    @staticmethod
    def body(prompt: str) -> dict[str, Any]:
        from cacheproxy.cli.settings import DEMO_MODEL_ID

        return {"model": DEMO_MODEL_ID, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX_TOKENS}

    @staticmethod
    def prompt(namespace_tag: str, i: int) -> str:
        base = animal_prompts(100)
        return f"{base[i % len(base)]} ({namespace_tag} #{i})"

    def request(self, prompt: str) -> Any:
        from cacheproxy.keys.canonical import parse
        from policies.sampling import SamplingMode

        return parse(self.body(prompt), "chat", self.runner.defaults(),
                     SamplingMode.FORCE_GREEDY).request

    def build(self, digest: str, tag: str, count: int) -> tuple[list[str], list[bytes]]:
        """count records of namespace `digest` (tag tells the prompts of namespaces apart)."""
        from cacheproxy import __version__
        from cacheproxy.keys import codec
        from cacheproxy.keys.key import make_key

        fingerprint = self.runner.fingerprint()
        fields = fingerprint.fields()
        keys: list[str] = []
        values: list[bytes] = []
        now = time.time()
        for i in range(count):
            request = self.request(self.prompt(tag, i))
            output, ms = self.answers[i % len(self.answers)]
            provenance = {"fingerprint": digest, "fingerprint_fields": fields,
                          "created_at": now + i * 1e-4, "generation_ms": round(ms, 3),
                          "proxy_version": __version__, "lane": "batch-of-one, cold prefill"}
            record = codec.Record(request=request.wire(), output=output, provenance=provenance)
            keys.append(str(make_key(request, digest)))
            values.append(codec.encode(record))
        return keys, values


def other_digest() -> str:
    """A second namespace: 32 hex digits, as a fingerprint digest is."""
    import xxhash

    return str(xxhash.xxh3_128_hexdigest(b"cost_curves: another fingerprint"))


# -- the store-level measurements -------------------------------------------------------------


async def fill(store: Any, keys: Sequence[str], values: Sequence[bytes]) -> float:
    """set() every entry, FILL_IN_FLIGHT at a time; the seconds it took."""
    started = time.perf_counter()
    it = iter(zip(keys, values, strict=True))

    async def worker() -> None:
        for key, value in it:
            await store.set(key, value)

    await asyncio.gather(*(worker() for _ in range(FILL_IN_FLIGHT)))
    return time.perf_counter() - started


async def timed_gets(store: Any, keys: Sequence[str]) -> list[float]:
    """µs of each get(), one at a time; every key must be there."""
    clock = time.perf_counter_ns
    out: list[float] = []
    missing = 0
    for key in keys:
        t0 = clock()
        value = await store.get(key)
        out.append((clock() - t0) / 1000)
        missing += value is None
    if missing:
        raise BenchError(f"{missing} of {len(keys)} stored keys were not found")
    return out


@dataclass
class Latency:
    p50: float
    p99: float
    rounds_p99: list[float]
    samples: int

    def as_dict(self) -> dict[str, Any]:
        return {"p50": round(self.p50, 2), "p99": round(self.p99, 2),
                "rounds_p99": [round(x, 2) for x in self.rounds_p99], "samples": self.samples}


def summary(rounds: list[list[float]]) -> Latency:
    pooled = [x for r in rounds for x in r]
    return Latency(pct(pooled, 0.5), pct(pooled, 0.99), [pct(r, 0.99) for r in rounds],
                   len(pooled))


async def hit_latency(store: Any, keys: Sequence[str], rounds: int, samples: int,
                      rng: random.Random) -> Latency:
    """GETs of random existing keys (without repeats while the keys last), in rounds."""
    return (await hit_latencies([(store, keys)], rounds, samples, rng))[0]


async def hit_latencies(targets: Sequence[tuple[Any, Sequence[str]]], rounds: int,
                        samples: int, rng: random.Random) -> list[Latency]:
    """hit_latency of each (store, keys), their rounds taking turns (the order alternating),
    so that what else runs on the machine weighs on all of them alike."""
    picks = [pick(rng, len(keys), rounds * samples) for _, keys in targets]
    out: list[list[list[float]]] = [[] for _ in targets]
    gc.collect()
    gc.disable()
    try:
        for (store, keys), chosen in zip(targets, picks, strict=True):  # warm-up
            await timed_gets(store, [keys[i] for i in chosen[:min(200, samples)]])
        for r in range(rounds):
            order = list(range(len(targets)))
            for t in order if r % 2 == 0 else order[::-1]:
                store, keys = targets[t]
                out[t].append(await timed_gets(store, [
                    keys[i] for i in picks[t][r * samples:(r + 1) * samples]]))
    finally:
        gc.enable()
    return [summary(rounds_) for rounds_ in out]


def pick(rng: random.Random, n: int, count: int) -> list[int]:
    """count indexes below n, distinct while n allows."""
    out: list[int] = []
    while len(out) < count:
        out += rng.sample(range(n), min(n, count - len(out)))
    return out


def disk_bytes(directory: Path) -> tuple[int, int]:
    """(allocated bytes as du counts them, apparent bytes) of the files under directory."""
    allocated = apparent = 0
    for path in directory.rglob("*"):
        if path.is_file():
            st = path.stat()
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


async def listing_costs(store: Any, namespace: str, n: int, rng: random.Random
                        ) -> dict[str, float]:
    """ms of one page of the namespace's keys (backends/listing.py, as `cacheproxy verify`
    and `export` list them), of the whole listing, and of the listing `verify --sample
    SAMPLE` reads."""
    from backends import listing

    prefix = namespace + "/"
    clock = time.perf_counter
    started = clock()
    page, _ = await listing.page(store, prefix, limit=PAGE)
    page_ms = (clock() - started) * 1000
    started = clock()
    everything = await listing.keys(store, prefix)
    all_s = clock() - started
    started = clock()
    sample = await listing.sample(store, prefix, SAMPLE, rng)
    sample_ms = (clock() - started) * 1000
    if not page or len(everything) != n or len(sample) != min(SAMPLE, n):
        raise BenchError(f"listing found {len(page)} keys in a page, {len(everything)} in all "
                         f"and {len(sample)} in a sample of {SAMPLE}, of {n}")
    return {"scan_page_ms": round(page_ms, 2), "list_all_s": round(all_s, 3),
            "sample_list_ms": round(sample_ms, 2)}


# -- the hit path over HTTP -------------------------------------------------------------------


def http_hits(url: str, bodies: Sequence[bytes], rounds: int) -> tuple[Latency, int]:
    """ms of each HIT through `cacheproxy serve`, one at a time on a keep-alive connection."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    per = max(1, len(bodies) // (rounds + 1))
    headers = {"Content-Type": "application/json"}
    out: list[list[float]] = []
    not_hit = 0
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds + 1):  # round 0 is the warm-up
            times = []
            for body in bodies[r * per:(r + 1) * per]:
                t0 = clock()
                conn.request("POST", "/v1/chat/completions", body, headers)
                resp = conn.getresponse()
                resp.read()
                times.append((clock() - t0) / 1e6)
                if resp.status != 200 or resp.getheader("X-Cache") != "HIT":
                    not_hit += 1
                    if not_hit == 1 and r == 0:
                        raise BenchError(f"{url} answered {resp.status} "
                                         f"X-Cache={resp.getheader('X-Cache')}: not a HIT "
                                         "(fingerprint or key mismatch?)")
            if r:
                out.append(times)
    finally:
        gc.enable()
        conn.close()
    return summary(out), not_hit


# -- one store --------------------------------------------------------------------------------


@dataclass
class StoreRun:
    store: str
    url: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    purge: dict[str, Any] = field(default_factory=dict)  # in this process, as a server does
    cli_purge: dict[str, Any] = field(default_factory=dict)  # `cacheproxy purge`'s, another
    timelines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    verify: dict[str, Any] = field(default_factory=dict)


async def run_store(name: str, url: str, ref_url: str, disk_dir: Path | None,
                    corpus: Corpus, main_entries: tuple[list[str], list[bytes]],
                    other_entries: tuple[list[str], list[bytes]],
                    args: argparse.Namespace, procs: Procs, work: Path) -> StoreRun:
    """The size sweep and the purges on one store. ref_url is a second store of the same
    kind, holding the smallest size throughout: each point's GETs take turns with its GETs."""
    from backends.base import NamespacePurge, Scan, ScanPages, StoreStats
    from cacheproxy.service.cassette import open_store

    result = StoreRun(name, url)
    rng = random.Random(f"{args.seed}-{name}")
    digest = corpus.runner.fingerprint().digest
    keys, values = main_entries
    store = await open_store(url)
    if not (isinstance(store, StoreStats) and isinstance(store, NamespacePurge)
            and isinstance(store, Scan | ScanPages)):
        raise BenchError(f"{store!r} lacks stats, purge or scan")
    ref = await open_store(ref_url)
    try:
        ref_n = args.sizes[0]
        ref_keys = keys[:ref_n]
        await fill(ref, ref_keys, values[:ref_n])
        empty = (await store.stats()).bytes if name == "redis" else 0
        filled = 0
        rate: float | None = None
        spent = 0.0
        for n in args.sizes:
            if rate is not None:
                projected = (n - filled) / rate
                if spent + projected > args.fill_budget:
                    result.skipped.append({"entries": n, "projected_fill_s": round(projected, 1),
                                           "fill_budget_s": args.fill_budget,
                                           "rate_per_s": round(rate)})
                    print(f"{name}: skipping {label(n)}: the fill would take ~{projected:.0f} s "
                          f"more at {rate:.0f}/s (budget {args.fill_budget:g} s, spent "
                          f"{spent:.0f} s)", file=sys.stderr, flush=True)
                    break
            seconds = await fill(store, keys[filled:n], values[filled:n])
            rate = (n - filled) / seconds
            spent += seconds
            print(f"{name}: filled {filled} -> {n} in {seconds:.1f} s ({rate:.0f}/s); "
                  f"load {load_line()}", file=sys.stderr, flush=True)
            filled = n
            stats = await store.stats()
            if stats.entries < n:
                raise BenchError(f"{name} holds {stats.entries} entries, expected >= {n}")
            hits, ref_hits = await hit_latencies([(store, keys[:n]), (ref, ref_keys)],
                                                 args.rounds, args.samples, rng)
            listed = await listing_costs(store, digest, n, rng)
            logical = stats.bytes if name == "disk" else sum(
                len(k) + len(v) for k, v in zip(keys[:n], values[:n], strict=True))
            row: dict[str, Any] = {
                "entries": n, "fill_s": round(seconds, 2), "fill_per_s": round(rate),
                "get_us": hits.as_dict(), "ref_get_us": ref_hits.as_dict(),
                "p99_vs_ref": round(hits.p99 / ref_hits.p99, 2),
                "p50_vs_ref": round(hits.p50 / ref_hits.p50, 2),
                **listed,
                "stored_bytes_per_entry": round(logical / n, 1), "load": load_line(),
            }
            if name == "redis":
                row["used_memory"] = stats.bytes
                row["bytes_per_entry"] = round((stats.bytes - empty) / n, 1)
            else:
                assert disk_dir is not None
                allocated, apparent = disk_bytes(disk_dir)
                row["du_bytes"], row["apparent_bytes"] = allocated, apparent
                row["bytes_per_entry"] = round(allocated / n, 1)
            if name == "disk":
                row["get_after_foreign_write_ms"] = await foreign_write_get_ms(
                    url, store, keys[:n], rng)
            if args.http and (not args.smoke or n == args.sizes[-1]):
                row["http_ms"] = await optional(
                    f"{name} {label(n)}: HTTP", http_point(url, corpus, n, args, procs, work, rng))
            result.rows.append(row)
            print(f"{name} {label(n)}: get p50 {hits.p50:.0f} µs p99 {hits.p99:.0f} µs "
                  f"(the {label(ref_n)} store alongside: {ref_hits.p50:.0f} / "
                  f"{ref_hits.p99:.0f}); {row['bytes_per_entry']:.0f} B/entry",
                  file=sys.stderr, flush=True)
        result.purge, result.timelines["in-process"] = await purge_phase(
            name, store, digest, filled, other_entries, args, rng)
        if args.cli_purge:
            seconds = await fill(store, keys[:filled], values[:filled])
            print(f"{name}: refilled {filled} in {seconds:.1f} s", file=sys.stderr, flush=True)
            try:
                result.cli_purge, result.timelines["cacheproxy purge"] = await purge_phase(
                    name, store, digest, filled, other_entries, args, rng, url=url)
                result.cli_purge["refill_s"] = round(seconds, 2)
            except (BenchError, OSError) as exc:
                result.cli_purge = failed(f"{name}: `cacheproxy purge`", exc)
    finally:
        await ref.aclose()
        await store.aclose()
    return result


def failed(what: str, exc: BaseException) -> dict[str, Any]:
    """An optional measurement that failed: said, recorded, and the run goes on."""
    error = f"{type(exc).__name__}: {exc}"
    print(f"{what} failed: {error}", file=sys.stderr, flush=True)
    return {"error": error}


async def optional(what: str, measurement: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """The measurement, or {"error": ...} when it fails (the tree may be mid-edit: a
    `cacheproxy serve` that does not start should not cost the whole run)."""
    try:
        return await measurement
    except Exception as exc:  # the bench's own errors and the code under test's alike
        return failed(what, exc)


async def http_point(url: str, corpus: Corpus, n: int, args: argparse.Namespace,
                     procs: Procs, work: Path, rng: random.Random) -> dict[str, Any]:
    """HIT latency through a `cacheproxy serve` started on the store as it is now."""
    count = args.http_samples * (args.rounds + 1)
    bodies = [json.dumps(corpus.body(corpus.prompt("main", i))).encode()
              for i in pick(rng, n, count)]
    server = await asyncio.to_thread(start_proxy, procs, work, "--store", url,
                                     log_level="warning")
    try:
        latency, not_hit = await asyncio.to_thread(http_hits, server.url, bodies, args.rounds)
    finally:
        await asyncio.to_thread(server.kill, signal.SIGTERM)
    if not_hit:
        raise BenchError(f"{not_hit} of {count} requests through {server.url} were no HIT")
    return latency.as_dict()


async def foreign_write_get_ms(url: str, store: Any, keys: Sequence[str],
                               rng: random.Random, times: int = 3) -> list[float]:
    """ms of a get() right after another connection (as another process has: `cacheproxy
    purge`, a second replica) committed one write to the same database."""
    from backends import open_backend

    other = open_backend(url)
    out = []
    try:
        for _ in range(times):
            await other.set("_cost_curves_probe", b"x")
            key = keys[rng.randrange(len(keys))]
            t0 = time.perf_counter()
            await store.get(key)
            out.append(round((time.perf_counter() - t0) * 1000, 3))
        await other.delete("_cost_curves_probe")
    finally:
        await other.aclose()
    return out


# What `cacheproxy purge --store URL --namespace DIGEST` runs (cacheproxy/cli/store.py), in a
# child that has imported and says "ready" first, so its start-up is not timed. SIGUSR1 pauses
# it and SIGUSR2 resumes it between two of its steps (Turns): stopped mid-step (SIGSTOP) it
# could hold the disk store's WAL index lock and stall every reader while it is stopped.
PURGE_CHILD = """
import asyncio, signal, sys
from cacheproxy.cli.store import purge
running = [True]  # (a plain flag: a threading.Event's lock is not safe in a signal handler)
signal.signal(signal.SIGUSR1, lambda *_: running.__setitem__(0, False))
signal.signal(signal.SIGUSR2, lambda *_: running.__setitem__(0, True))
async def paused():
    while not running[0]:
        await asyncio.sleep(0.001)
print("ready", flush=True)
sys.stdin.readline()
code = asyncio.run(purge(sys.argv[1], superseded=False, namespace=sys.argv[2], key=None,
                         everything=False, confirm=lambda _: False, pause=paused))
for turn in (signal.SIGUSR1, signal.SIGUSR2):  # (one sent as it ends would kill it)
    signal.signal(turn, signal.SIG_IGN)
sys.exit(code)
"""


class Turns:
    """Runs and pauses a purge in turns of `turn` seconds, so that the GETs while it runs
    and while it pauses are measured in the same seconds: what else runs on the machine
    (here: other engineers' test suites and benchmarks, load 2-5) weighs on both alike,
    where a "before" measured a minute earlier may have met another load. A purge pauses
    between two of its steps, through the `pause` a purge awaits there (Redis after its
    rest, so the rest is measured without it): here, or in the child (PURGE_CHILD, the
    `cacheproxy purge` command's own function, told by SIGUSR1 and SIGUSR2)."""

    def __init__(self, child: Any, turn: float) -> None:
        self.turn = turn
        self.running = True
        self.switched = time.perf_counter()
        self.ran = 0.0  # seconds the purge has run, so far
        self._child = child
        self._gate = asyncio.Event()
        self._gate.set()

    async def pause(self) -> None:
        """What an in-process purge awaits between two steps (its `pause`)."""
        await self._gate.wait()

    def tick(self, now: float) -> None:
        """Pause or resume when a turn is over."""
        if self.turn <= 0 or now - self.switched < self.turn:
            return
        if self.running:
            self.ran += now - self.switched
        self.running, self.switched = not self.running, now
        self._set(self.running)

    def _set(self, running: bool) -> None:
        if self._child is not None:
            if self._child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._child.pid, signal.SIGUSR2 if running else signal.SIGUSR1)
            return
        self._gate.set() if running else self._gate.clear()

    def close(self, now: float) -> None:
        """Resume for good."""
        if self.running:
            self.ran += now - self.switched
        self._set(True)


async def purge_phase(name: str, store: Any, digest: str, filled: int,
                      other_entries: tuple[list[str], list[bytes]], args: argparse.Namespace,
                      rng: random.Random, *, url: str | None = None
                      ) -> tuple[dict[str, Any], list[tuple[float, float]]]:
    """Purge the big namespace while GETs of another (10k) run; before, during, after.
    In this process (the admin API's and the invalidator's path) unless url is given: then
    `cacheproxy purge`'s code in a child process."""
    other_keys, other_values = other_entries
    seconds = await fill(store, other_keys, other_values)
    print(f"{name}: other namespace filled ({len(other_keys)} in {seconds:.1f} s)",
          file=sys.stderr, flush=True)
    before = await hit_latency(store, other_keys, args.rounds, args.samples, rng)
    child = None
    if url is not None:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PURGE_CHILD, url, digest, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert child.stdin is not None and child.stdout is not None
        if await child.stdout.readline() != b"ready\n":
            raise BenchError(f"the purge child did not start: {await child.stderr.read()!r}"
                             if child.stderr else "the purge child did not start")
    timeline: list[tuple[float, float]] = []
    during: list[float] = []  # while the purge runs
    paused: list[float] = []  # while it pauses, in the same seconds
    clock = time.perf_counter_ns
    turns = Turns(child, args.purge_turns)
    gc.collect()
    gc.disable()
    try:
        started = clock()
        if child is None:
            task: asyncio.Task[Any] = asyncio.create_task(
                store.purge_namespace(digest, pause=turns.pause if args.purge_turns > 0
                                      else None))
        else:
            assert child.stdin is not None
            child.stdin.write(b"go\n")
            await child.stdin.drain()
            task = asyncio.create_task(child.communicate())
        await asyncio.sleep(0)  # let the purge start
        while not during or not task.done():  # at least one GET, however short the purge
            key = other_keys[rng.randrange(len(other_keys))]
            t0 = clock()
            value = await store.get(key)
            t1 = clock()
            if value is None:
                raise BenchError("a GET of the other namespace missed during the purge")
            (during if turns.running else paused).append((t1 - t0) / 1000)
            if turns.running:
                timeline.append(((t0 - started) / 1e9, (t1 - t0) / 1000))
            turns.tick(t1 / 1e9)
        outcome = await task
        purge_s = (clock() - started) / 1e9
    finally:
        gc.enable()
        turns.close(time.perf_counter())
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()
    if child is None:
        removed = int(outcome)
    else:
        out, err = outcome
        words = out.decode().split()
        if child.returncode != 0 or words[:1] != ["removed"]:
            raise BenchError(f"the purge child failed ({child.returncode}): {err[-500:]!r}")
        removed = int(words[1])
    after = await hit_latency(store, other_keys, args.rounds, args.samples, rng)
    left = (await store.namespace_stats(other_digest()))[0]
    if removed != filled or left != len(other_keys):
        raise BenchError(f"{name}: the purge removed {removed} of {filled} entries and left "
                         f"{left} of the other namespace's {len(other_keys)}")
    during_lat = summary([during])
    ratio = during_lat.p99 / before.p99
    paused_lat = summary([paused]) if paused else None
    # One at a time, a stall is one slow sample however long it lasts; requests arriving
    # together (a server's) would all wait for it: so also the time spent in slow GETs.
    slow = [us for us in during if us > SLOW_GET_US]
    where = "in this process" if child is None else "by `cacheproxy purge` (another process)"
    print(f"{name}: purged {removed} {where} in {purge_s:.1f} s; other namespace p99 "
          f"{before.p99:.0f} -> {during_lat.p99:.0f} µs during ({ratio:.2f}x)"
          + (f", {paused_lat.p99:.0f} µs in its pauses" if paused_lat else ""),
          file=sys.stderr, flush=True)
    running_s = turns.ran if paused else purge_s  # its speed: per second it ran
    return {"entries": removed, "seconds": round(purge_s, 4), "turn_s": args.purge_turns,
            "running_s": round(running_s, 2), "per_s": round(removed / running_s),
            "other_entries": len(other_keys),
            **({"paused_us": paused_lat.as_dict(),
                "p99_vs_paused": round(during_lat.p99 / paused_lat.p99, 2)} if paused_lat
               else {}),
            "before_us": before.as_dict(), "during_us": during_lat.as_dict(),
            "after_us": after.as_dict(), "max_during_us": round(max(during), 1),
            "slow_gets": len(slow), "slow_s": round(sum(slow) / 1e6, 2),
            "slow_share": round(sum(slow) / 1e6 / running_s, 3),
            "p99_ratio": round(ratio, 2)}, timeline


# -- verify -----------------------------------------------------------------------------------


async def verify_phase(runner: Any, url: str, count: int) -> dict[str, Any]:
    """Generate count entries through an in-process proxy, then time `verify` over them."""
    import aiohttp
    from aiohttp import web

    from backends import open_backend
    from cacheproxy.cli.serve import build_app
    from cacheproxy.cli.settings import Settings
    from cacheproxy.cli.verify import verify
    from cacheproxy.runners.demo.model import BUNDLED_MODEL

    settings = Settings(store=url, model=str(BUNDLED_MODEL), watch=False, log_level="warning")
    backend = open_backend(url)
    app = build_app(settings, runner=runner, store=backend)
    app_runner = web.AppRunner(app, access_log=None)
    await app_runner.setup()
    port = free_port()
    await web.TCPSite(app_runner, HOST, port).start()
    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession() as session:
            for prompt in animal_prompts(count):
                async with session.post(f"http://{HOST}:{port}/v1/chat/completions",
                                        json=Corpus.body(prompt)) as resp:
                    await resp.read()
                    if resp.status != 200 or resp.headers.get("X-Cache") != "MISS":
                        raise BenchError(f"generating {prompt!r}: {resp.status} "
                                         f"X-Cache={resp.headers.get('X-Cache')}")
        generate_s = time.perf_counter() - started
    finally:
        await app_runner.cleanup()
        await backend.aclose()
    started = time.perf_counter()
    report = await verify(runner, url, namespace=None, sample=None, cross_fingerprint=False,
                          progress=False)
    verify_s = time.perf_counter() - started
    if report.checked != count:
        raise BenchError(f"verify checked {report.checked} of {count} entries")
    return {"entries": report.checked, "matched": report.matched,
            "exact_match_rate": report.exact_match_rate,
            "generate_s": round(generate_s, 2), "generate_per_s": round(count / generate_s, 2),
            "verify_s": round(verify_s, 2), "verify_per_s": round(count / verify_s, 2)}


# -- the run ----------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, procs: Procs, work: Path) -> dict[str, Any]:
    from cacheproxy.cli.settings import DEMO_MODEL_ID
    from cacheproxy.observe import logs
    from cacheproxy.runners.demo.model import BUNDLED_MODEL
    from cacheproxy.runners.mlx import MlxOptions, MlxRunner

    # Everything this process will run, imported now: other people may be editing the tree
    # while a long run goes on, and a module imported late could be caught half-written.
    __import__("cacheproxy.cli.serve")
    __import__("cacheproxy.cli.verify")
    __import__("aiohttp.web")
    logs.configure(fmt="console", level="warning")
    logging.getLogger().setLevel(logging.WARNING)
    started = time.monotonic()
    runner = MlxRunner(MlxOptions(model=str(BUNDLED_MODEL), model_id=DEMO_MODEL_ID))
    await runner.start()
    try:
        corpus = Corpus(runner)
        await corpus.generate_answers(args.answers)
        t0 = time.perf_counter()
        largest = max(args.sizes)
        main_entries = corpus.build(runner.fingerprint().digest, "main", largest)
        other_entries = corpus.build(other_digest(), "other", args.other)
        build_s = time.perf_counter() - t0
        sizes = [len(v) for v in main_entries[1]]
        print(f"built {largest + args.other} records in {build_s:.1f} s (mean "
              f"{sum(sizes) / len(sizes):.0f} B); load {load_line()}", file=sys.stderr,
              flush=True)
        gc.collect()
        gc.freeze()  # the records stay: no collection walks them again
        redis_url = ref_redis = None
        if "redis" in args.stores:
            redis_url, ref_redis = start_redis(procs, work).url, start_redis(procs, work).url
        runs: list[StoreRun] = []
        for name in args.stores:
            if name == "disk":
                directory = work / "disk-store"
                url = f"disk://{directory}?max_bytes={DISK_MAX_BYTES}"
                ref_url = f"disk://{work / 'disk-ref'}?max_bytes={DISK_MAX_BYTES}"
                run_ = await run_store(name, url, ref_url, directory, corpus, main_entries,
                                       other_entries, args, procs, work)
                verify_url = f"disk://{work / 'verify-disk'}"
            else:
                url = f"{redis_url}/0"
                run_ = await run_store(name, url, f"{ref_redis}/0", None, corpus, main_entries,
                                       other_entries, args, procs, work)
                verify_url = f"{redis_url}/1"
            if args.verify:
                run_.verify = await optional(f"{name}: verify",
                                             verify_phase(runner, verify_url, args.verify))
                if "error" not in run_.verify:
                    print(f"{name}: verify {run_.verify['verify_per_s']} entries/s",
                          file=sys.stderr, flush=True)
            runs.append(run_)
    finally:
        await runner.aclose()
    return {
        "runtime": runtime_line(), "smoke": args.smoke, "sizes": args.sizes,
        "record_bytes_mean": round(sum(sizes) / len(sizes), 1),
        "key_chars": len(main_entries[0][0]),
        "rounds": args.rounds, "samples_per_round": args.samples,
        "http_samples_per_round": args.http_samples if args.http else 0,
        "load_before": args.load_before, "load_after": load_line(),
        "elapsed_s": round(time.monotonic() - started, 1),
        "targets": {"p99_growth": P99_GROWTH_TARGET, "purge_p99": PURGE_TARGET},
        "stores": {r.store: {"url": r.url, "rows": r.rows, "skipped": r.skipped,
                             "purge": r.purge, "cli_purge": r.cli_purge,
                             "verify": r.verify, "growth": growth(r)} for r in runs},
        "purge_timelines": {r.store: r.timelines for r in runs},
    }


def growth(r: StoreRun) -> dict[str, Any]:
    first, last = r.rows[0], r.rows[-1]
    ratio = last["get_us"]["p99"] / first["get_us"]["p99"]
    out: dict[str, Any] = {"from": first["entries"], "to": last["entries"],
                           "p99_ratio": round(ratio, 2),
                           "p50_ratio": round(last["get_us"]["p50"] / first["get_us"]["p50"], 2),
                           "paired_p99_ratio": last["p99_vs_ref"],
                           "paired_p50_ratio": last["p50_vs_ref"]}
    if "p99" in first.get("http_ms", {}) and "p99" in last.get("http_ms", {}) \
            and first is not last:
        out["http_p99_ratio"] = round(last["http_ms"]["p99"] / first["http_ms"]["p99"], 2)
    return out


def verdict(ratio: float, target: float) -> str:
    return f"{'ok' if ratio <= target else 'BELOW'} (<= {target:g}x)"


PURGES = (("purge", "in this process"), ("cli_purge", "by `cacheproxy purge`"))


def markdown(result: dict[str, Any]) -> str:
    stores = result["stores"]
    rows = []
    for name, s in stores.items():
        for row in s["rows"]:
            g, h = row["get_us"], row.get("http_ms")
            foreign = row.get("get_after_foreign_write_ms")
            rows.append([
                name, label(row["entries"]), f"{row['fill_per_s']}",
                f"{g['p50']:.0f} / {g['p99']:.0f}", " ".join(f"{x:.0f}" for x in g["rounds_p99"]),
                f"{row['ref_get_us']['p50']:.0f} / {row['ref_get_us']['p99']:.0f}",
                f"{row['p99_vs_ref']:.2f}",
                "-" if not h else f"{h['p50']:.2f} / {h['p99']:.2f}" if "p99" in h
                else "error",
                f"{row['bytes_per_entry']:.0f}", f"{row['stored_bytes_per_entry']:.0f}",
                f"{row['scan_page_ms']:.1f}",
                f"{row['list_all_s']:.2f}" if "list_all_s" in row else "-",
                f"{row['sample_list_ms']:.1f}" if "sample_list_ms" in row else "-",
                " ".join(f"{x:.1f}" for x in foreign) if foreign else "-"])
    out = [table(["store", "entries", "fill entries/s", "store GET p50 / p99 µs",
                  "round p99s µs", f"{label(result['sizes'][0])} store alongside p50 / p99 µs",
                  "p99 / alongside", "HTTP HIT p50 / p99 ms", "bytes/entry (Redis used_memory, "
                  "disk du)", "key+value B/entry", "listing: a page ms", "all keys s",
                  f"`verify --sample {SAMPLE}`'s pages ms",
                  "GET after another connection's write ms"], rows, "ll")]
    skipped = [f"{name}: {label(s['entries'])} not filled (projected {s['projected_fill_s']} s "
               f"at {s['rate_per_s']}/s, budget {s['fill_budget_s']} s)"
               for name, st in stores.items() for s in st["skipped"]]
    if skipped:
        out.append("Sizes left out (nothing extrapolated): " + "; ".join(skipped))
    t = result["targets"]
    rows = []
    for name, s in stores.items():
        g = s["growth"]
        rows.append([name, f"store GET p99 at {label(g['to'])} / at {label(g['from'])}, "
                     f"the two points of the sweep (p50: {g['p50_ratio']:.2f})",
                     f"{g['p99_ratio']:.2f}", verdict(g["p99_ratio"], t["p99_growth"])])
        rows.append([name, f"store GET p99 at {label(g['to'])} / a {label(g['from'])} store "
                     f"read in turns with it (p50: {g['paired_p50_ratio']:.2f})",
                     f"{g['paired_p99_ratio']:.2f}",
                     verdict(g["paired_p99_ratio"], t["p99_growth"])])
        if "http_p99_ratio" in g:
            rows.append([name, f"HTTP HIT p99 at {label(g['to'])} / at {label(g['from'])}",
                         f"{g['http_p99_ratio']:.2f}", verdict(g["http_p99_ratio"],
                                                               t["p99_growth"])])
        for kind, how in PURGES:
            if (p := s[kind]) and "error" not in p:
                rows.append([name, f"GET p99 of a {label(p['other_entries'])} namespace during "
                             f"the purge of {label(p['entries'])} {how} / before it",
                             f"{p['p99_ratio']:.2f}", verdict(p["p99_ratio"], t["purge_p99"])])
                if "p99_vs_paused" in p:
                    rows.append([name, f"the same, during the purge's steps / during its pauses "
                                 f"(turns of {p['turn_s']:g} s, the same seconds)",
                                 f"{p['p99_vs_paused']:.2f}",
                                 verdict(p["p99_vs_paused"], t["purge_p99"])])
    out.append(table(["store", "target", "ratio", "verdict"], rows, "lll"))
    rows = []
    for name, s in stores.items():
        for kind, how in PURGES:
            if (p := s[kind]) and "error" not in p:
                paused = p.get("paused_us")
                rows.append([name, how, label(p["entries"]),
                             f"{p['seconds']:.1f} ({p.get('running_s', p['seconds']):.1f})",
                             f"{p['per_s']}",
                             f"{p['before_us']['p50']:.0f} / {p['before_us']['p99']:.0f}",
                             f"{p['during_us']['p50']:.0f} / {p['during_us']['p99']:.0f}",
                             f"{paused['p50']:.0f} / {paused['p99']:.0f}" if paused else "-",
                             f"{p['max_during_us'] / 1000:.1f}",
                             f"{p['slow_gets']}: {p['slow_s']:.1f} s "
                             f"({p['slow_share']:.0%})",
                             f"{p['after_us']['p50']:.0f} / {p['after_us']['p99']:.0f}",
                             p["during_us"]["samples"], f"{p['p99_ratio']:.2f}",
                             f"{p['p99_vs_paused']:.2f}" if paused else "-"])
    out.append(table(["store", "purge", "purged", "purge s (running)", "entries/s running",
                      "other ns GET p50 / p99 µs before", "during its steps", "in its pauses",
                      "max during ms",
                      f"GETs over {SLOW_GET_US // 1000} ms during: count, s (share of the purge)",
                      "after",
                      "GETs during", "p99 during / before", "p99 during / pauses"], rows, "ll"))
    rows = []
    for name, s in stores.items():
        v = s["verify"]
        if v and "error" not in v:
            rows.append([name, v["entries"], f"{v['generate_s']:.1f}", f"{v['generate_per_s']}",
                         f"{v['verify_s']:.1f}", f"{v['verify_per_s']}",
                         f"{v['exact_match_rate']:.0%}"])
    if rows:
        out.append(table(["store", "entries", "generated through the proxy s", "entries/s",
                          "verify s", "verify entries/s", "exact match"], rows, "l"))
    if errors := errors_of(result):
        out.append("Failed (left out above): " + "; ".join(errors))
    return "\n\n".join(out)


def errors_of(result: dict[str, Any]) -> list[str]:
    """The optional measurements that failed."""
    out = []
    for name, s in result["stores"].items():
        out += [f"{name} {label(r['entries'])} HTTP: {r['http_ms']['error']}"
                for r in s["rows"] if "error" in r.get("http_ms", {})]
        out += [f"{name} {kind}: {s[kind]['error']}" for kind in ("cli_purge", "verify")
                if "error" in s[kind]]
    return out


def plot(result: dict[str, Any], out: Path) -> Path:
    fig, axes = figure(2, 2, (12, 9))
    (lat, size), (purge, timeline) = axes
    colors = {"disk": "tab:blue", "redis": "tab:red"}
    markers = {"in-process": ".", "cacheproxy purge": "x"}
    for name, s in result["stores"].items():
        ns = [r["entries"] for r in s["rows"]]
        c = colors.get(name)
        lat.plot(ns, [r["get_us"]["p50"] for r in s["rows"]], "o--", color=c,
                 label=f"{name} store GET p50")
        lat.plot(ns, [r["get_us"]["p99"] for r in s["rows"]], "o-", color=c,
                 label=f"{name} store GET p99")
        lat.plot(ns, [r["ref_get_us"]["p99"] for r in s["rows"]], "^-.", color=c, alpha=0.5,
                 label=f"{name}: a {label(result['sizes'][0])} store alongside, p99")
        http_rows = [r for r in s["rows"] if "p99" in r.get("http_ms", {})]
        if http_rows:
            lat.plot([r["entries"] for r in http_rows],
                     [r["http_ms"]["p99"] * 1000 for r in http_rows], "s:", color=c,
                     label=f"{name} HTTP HIT p99")
        size.plot(ns, [r["bytes_per_entry"] for r in s["rows"]], "o-", color=c,
                  label=f"{name} ({'used_memory' if name == 'redis' else 'du'})")
        size.plot(ns, [r["stored_bytes_per_entry"] for r in s["rows"]], "x:", color=c,
                  label=f"{name} key + value")
        for kind, points in result["purge_timelines"].get(name, {}).items():
            took = s["purge" if kind == "in-process" else "cli_purge"].get("seconds")
            if points and took:
                timeline.plot([p[0] / took for p in points], [p[1] for p in points],
                              markers.get(kind, "."), color=c, markersize=2, alpha=0.5,
                              label=f"{name}, {kind} ({took:.1f} s)")
    lat.set_xscale("log")
    lat.set_yscale("log")
    lat.set_xlabel("entries in the namespace")
    lat.set_ylabel("µs (one at a time)")
    lat.set_title("Hit latency vs cache size")
    lat.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    size.set_xscale("log")
    size.set_xlabel("entries in the namespace")
    size.set_ylabel("bytes per entry")
    size.set_ylim(bottom=0)
    size.set_title("Store size per entry")
    size.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    names = list(result["stores"])
    phases = [("before", "purge", "before_us"), ("during (in process)", "purge", "during_us"),
              ("during (cacheproxy purge)", "cli_purge", "during_us"),
              ("after", "purge", "after_us")]
    phases = [ph for ph in phases if all(ph[2] in result["stores"][n][ph[1]] for n in names)]
    width = 0.8 / len(phases)
    for k, (legend, kind, phase) in enumerate(phases):
        purge.bar([i + (k - (len(phases) - 1) / 2) * width for i in range(len(names))],
                  [result["stores"][n][kind][phase]["p99"] for n in names], width,
                  label=legend)
    purge.set_xticks(range(len(names)), [
        f"{n}: purge of {label(result['stores'][n]['purge']['entries'])}" + "".join(
            f"\n{result['stores'][n][kind]['seconds']:.1f} s {how.removeprefix('by ')}"
            for kind, how in PURGES if "seconds" in result["stores"][n][kind])
        for n in names], fontsize=8)
    purge.set_yscale("log")
    purge.set_ylabel("GET p99 µs, another namespace")
    purge.set_title(f"Hit p99 around a purge (target during <= {PURGE_TARGET:g}x without)")
    purge.legend(fontsize=7)
    timeline.set_yscale("log")
    timeline.set_xlabel("time since the purge started, as a fraction of its duration")
    timeline.set_ylabel("GET µs, another namespace")
    timeline.set_title("Each GET during the purge")
    timeline.legend(fontsize=7, markerscale=4)
    return save(fig, out / "cost_curves.png")


def thin(points: list[tuple[float, float]], most: int = 2000) -> list[tuple[float, float]]:
    """At most `most` points of a timeline, for the JSON: every k-th one and the slowest
    (so that a redrawn plot keeps the tail); the figures are of all of them."""
    if len(points) <= most:
        return points
    step = -(-len(points) // (most // 2))
    slowest = sorted(range(len(points)), key=lambda i: points[i][1])[-(most // 2):]
    return [points[i] for i in sorted(set(range(0, len(points), step)) | set(slowest))]


def main(args: argparse.Namespace) -> int:
    if args.replot is not None:  # draw and print a run's JSON again (its thinned timelines)
        result = json.loads(args.replot.read_text())
        plot(result, args.out)
        print(markdown(result))
        return 0
    print(f"runtime: {runtime_line()}; load {args.load_before}", file=sys.stderr)
    import uvloop

    with tempfile.TemporaryDirectory(prefix="lt_cost_") as tmp, children() as procs:
        result = uvloop.run(measure(args, procs, Path(tmp)))
    args.out.mkdir(parents=True, exist_ok=True)
    timelines = result.pop("purge_timelines")
    (args.out / "cost_curves.json").write_text(json.dumps(
        {**result, "purge_timelines": {
            store: {kind: [[round(t, 4), round(us, 1)] for t, us in thin(points)]
                    for kind, points in kinds.items()}
            for store, kinds in timelines.items()}}, indent=1))
    result["purge_timelines"] = timelines
    plot(result, args.out)
    print(f"{result['runtime']}; load average {result['load_before']} before, "
          f"{result['load_after']} after; {result['elapsed_s']} s\n")
    print(markdown(result))
    return 1 if errors_of(result) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--stores", default=",".join(STORES), help="comma-separated: disk, redis")
    p.add_argument("--sizes", help="comma-separated entry counts, e.g. 10k,100k,1M "
                   "(default 10k,100k,1M; --smoke 1k,3k)")
    p.add_argument("--other", type=parse_size, help="entries of the namespace read during "
                   "the purge (default 10k; --smoke 1k)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of GETs per point")
    p.add_argument("--samples", type=int, help="GETs per round (default 5000; --smoke 300)")
    p.add_argument("--http-samples", type=int, help="HTTP HITs per round (default 2000; "
                   "--smoke 100)")
    p.add_argument("--no-http", dest="http", action="store_false",
                   help="skip the hit path through `cacheproxy serve`")
    p.add_argument("--no-cli-purge", dest="cli_purge", action="store_false",
                   help="skip the second purge, by `cacheproxy purge`'s code in another "
                   "process (after filling the namespace again)")
    p.add_argument("--purge-turns", type=float, metavar="S",
                   help="the purges run and pause in turns of S seconds, GETs measured in "
                   "both (default 0.1; --smoke 0.02; 0: they run throughout)")
    p.add_argument("--verify", type=int, help="entries verify replays per store "
                   "(default 100; --smoke 5; 0 skips)")
    p.add_argument("--answers", type=int, default=20,
                   help="real demo-model answers the records are made of")
    p.add_argument("--fill-budget", type=float, default=480.0,
                   help="seconds of filling per store before a size is left out")
    p.add_argument("--seed", default="cost-curves")
    p.add_argument("--smoke", action="store_true",
                   help="1k and 3k entries, a 3k purge, 5 verified entries")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the PNG and JSON")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="measure nothing: draw the PNG (in --out) and print the tables of a "
                   "cost_curves.json again")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.sizes = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()}) \
        if args.sizes else list(SMOKE_SIZES if smoke else SIZES)
    args.other = args.other or (1_000 if smoke else 10_000)
    args.samples = args.samples or (300 if smoke else 5_000)
    args.http_samples = args.http_samples or (100 if smoke else 2_000)
    if args.verify is None:
        args.verify = 5 if smoke else 100
    if args.purge_turns is None:
        args.purge_turns = 0.02 if smoke else 0.1
    if smoke:
        args.rounds = min(args.rounds, 2)
        args.answers = min(args.answers, 4)
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not args.stores or not set(args.stores) <= set(STORES):
        p.error(f"--stores: choose from {', '.join(STORES)}")
    if args.rounds < 1 or args.samples < 1 or args.http_samples < 1 or args.answers < 1:
        p.error("--rounds, --samples, --http-samples and --answers must be >= 1")
    args.load_before = load_line()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return args


if __name__ == "__main__":
    sys.exit(run(main, parse_args(), "cost_curves"))
