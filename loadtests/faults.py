"""Fault injection: what cacheproxy does when its store, itself, its runner or its clients fail.

An experiment, not a test. Everything runs on 127.0.0.1 with private processes, each scenario
with its own servers, bounded in time:

  redis-restart    redis-server (append-only file) stopped and restarted under load:
                   expect 0 failed requests, BYPASS while it is down, no entry lost
  proxy-sigkill    `cacheproxy serve --store disk://` SIGKILLed during a write burst, then
                   restarted on the same directory: expect every acknowledged entry present
                   and 0 corrupt entries served
  runner-killed    the upstream mlx_lm.server SIGKILLed mid-generation: expect clean 502s,
                   no partial entries, recovery once it is back
  disconnects      a storm of streaming clients hanging up after the first chunk: expect
                   every started fill completed and stored
  hostile          >= 10,000 malformed or hostile requests generated with hypothesis, plus
                   truncated chunked bodies and invalid UTF-8 over raw sockets: expect no
                   5xx and the server alive and answering afterwards
  soak             steady load for --soak-seconds: resident memory and open file descriptors
                   at the end vs after warm-up (/proc/PID/status VmRSS, /proc/PID/fd)
  schema-flood     --flooders clients (2) send a response_format of --flood-properties
                   (10,000: 340 KB) back to back while a HIT is timed: expect its median
                   under 50 ms (the schema checks run off the event loop)
  regex-bombs      --bombs (50) distinct 170-byte regex-bomb schemas, one after another:
                   expect each a 400 schema_too_complex and the server's RSS within
                   +200 MB of before (nothing that failed is cached)
  slow-bodies      --slow-bodies connections (1,000) send their headers, then a body byte
                   every 3 s, while 100 fresh clients (a connection each) and 10 keep-alive
                   clients connected before (asking every 5 s) ask for a HIT: expect >= 95 %
                   of the fresh ones and every keep-alive one served; three runs: closed
                   connections stay closed, the same with only the connection guard (no
                   rate floor, no body bound), and an attacker that reopens them
  slowloris        --slowloris connections (1,000: the --max-connections default) trickle
                   their headers a byte at a time while a normal client sends 100 requests,
                   each on a new connection: expect >= 99 answered, p99 under 100 ms
  unread           --unread clients (100) ask for a large answer (16 choices x 500 tokens x
                   20 logprobs: ~12 MB) and never read it, while a normal client sends 100
                   HITs: expect the proxy's RSS to grow by under 1 MiB per unread client
                   (reported before, held and after) and the HITs' p99 under 50 ms
  disk-full        a disk store on a 1 MB tmpfs filled to the brim (a junk file, then entries
                   until the store refuses one): expect every stored entry still a HIT, the
                   same answer, and every new one `MISS; reason=store-full`
  disk-full-restart  entries stored, the proxy stopped cleanly, an 8 MB tmpfs filled, the proxy
                   started again: expect every stored entry a HIT, new ones `MISS;
                   reason=store-full`, the breaker closed; then the junk removed: expect new
                   answers stored again within ~10 s (the refusal backoff, then the store's
                   writable retry: 5 s each)
  read-only        entries stored, the tmpfs remounted read-only, the proxy started on it:
                   expect every stored entry a HIT, new ones `MISS; reason=store-read-only`,
                   no crash; then the same after a writer that was SIGKILLed (its WAL left)
  corrupt          the database file's pages overwritten while the proxy serves it, then
                   again while it is stopped: expect every request answered, the file
                   quarantined both times, every entry stored again, nothing wrong served

Mounting a tmpfs takes root: without it the disk scenarios say so, and are not as expected.

    python loadtests/faults.py                           # all, 600 s soak
    python loadtests/faults.py --soak-seconds 120 --only soak,hostile
    python loadtests/faults.py --smoke --out /tmp/f      # tiny sizes, a few seconds each

Prints a Markdown table and writes faults.png (soak RSS / fds over time) and .json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (imported by the suite too)

import broken_disks
import hostile
import hostile_load
from broken_disks import MountImpossible
from common import (
    PATH,
    RESULTS,
    BenchError,
    Procs,
    Server,
    children,
    demo_model,
    figure,
    http,
    run,
    runtime_line,
    save,
    start_proxy,
    start_redis,
    start_upstream,
    table,
)

EOS = json.loads((Path(__file__).resolve().parents[1]
                  / "cacheproxy/runners/demo/data/demo-model/config.json")
                 .read_text())["eos_token_id"]
NO_EOS = {str(t): -100 for t in EOS}  # generations run to max_tokens


@dataclass
class Outcome:
    """One scenario's counts; `lost`/`corrupt` count entries, the rest requests."""

    scenario: str
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    lost: int = 0
    corrupt: int = 0
    expected: str = ""
    notes: str = ""
    caches: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    ok: bool = True


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": content}],
            "max_tokens": 16, **extra}  # (extra may name another model)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
               ) -> tuple[int, str, bytes]:
    """(status, X-Cache, body); status 0 on a connection error or timeout."""
    try:
        async with session.post(url + PATH, json=body) as resp:
            data = await resp.read()
            return resp.status, resp.headers.get("X-Cache", "-").split(";")[0], data
    except (aiohttp.ClientError, TimeoutError):
        return 0, "ERROR", b""


def content(data: bytes) -> str | None:
    try:
        return str(json.loads(data)["choices"][0]["message"]["content"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def closed_loop(url: str, bodies: Callable[[int], dict[str, Any]], conns: int,
                      seconds: float, events: Sequence[tuple[float, Callable[[], None]]] = ()
                      ) -> tuple[Counter[int], Counter[str]]:
    """conns workers sending back to back for `seconds`; events fire (in a thread) at offsets."""
    statuses: Counter[int] = Counter()
    caches: Counter[str] = Counter()
    stop_at = time.monotonic() + seconds
    counter = iter(range(10**9))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                status, cache, _ = await post(session, url, bodies(next(counter)))
                statuses[status] += 1
                caches[cache] += 1

        async def fire() -> None:
            start = time.monotonic()
            for offset, action in events:
                await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
                await asyncio.to_thread(action)

        await asyncio.gather(fire(), *(worker() for _ in range(conns)))
    return statuses, caches


def in_process_proxy(procs: Procs, work: Path, *args: str, port: int | None = None) -> Server:
    return start_proxy(procs, work, "--model-id", "demo", "--max-tokens-cap", "512", *args,
                       port=port)


# -- scenarios ------------------------------------------------------------------------------


def redis_restart(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("redis-restart", expected="0 failed; BYPASS while down; 0 lost")
    with children() as procs:
        redis_dir = work / "redis"
        redis_dir.mkdir()
        rs = start_redis(procs, redis_dir, extra=("--appendonly", "yes", "--appendfsync",
                                                  "always"))
        proxy = in_process_proxy(procs, work, "--store", rs.url + "/0", "--store-retry", "1")
        prompts = [f"What does the fox eat? ({i})" for i in range(args.pool)]

        async def prime() -> list[tuple[int, str, bytes]]:
            async with aiohttp.ClientSession() as s:
                return [await post(s, proxy.url, chat(p)) for p in prompts]

        primed = asyncio.run(prime())
        third = args.fault_seconds / 3
        state: dict[str, Server] = {"redis": rs}

        def stop() -> None:
            state["redis"].kill(signal.SIGTERM)

        def start() -> None:
            state["redis"] = procs.restart(state["redis"])

        statuses, caches = asyncio.run(closed_loop(
            proxy.url, lambda i: chat(prompts[i % len(prompts)]), 8, args.fault_seconds,
            [(third, stop), (2 * third, start)]))
        time.sleep(1.5)  # past --store-retry: the breaker closes again

        async def check() -> list[tuple[int, str, bytes]]:
            async with aiohttp.ClientSession() as s:
                return [await post(s, proxy.url, chat(p)) for p in prompts]

        after = asyncio.run(check())
    out.sent = sum(statuses.values())
    out.succeeded = statuses[200]
    out.failed = out.sent - out.succeeded
    out.caches = dict(caches)
    out.lost = sum(1 for a in after if a[1] != "HIT")
    out.corrupt = sum(1 for a, p in zip(after, primed, strict=True)
                      if a[1] == "HIT" and content(a[2]) != content(p[2]))
    out.notes = (f"redis down from {third:.0f} s to {2 * third:.0f} s of {args.fault_seconds:g}"
                 f" s (SIGTERM, append-only file); {len(prompts)} primed entries re-read after")
    out.ok = out.failed == 0 and out.lost == 0 and out.corrupt == 0 and caches["BYPASS"] > 0
    return out


def proxy_sigkill(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("proxy-sigkill", expected="every acknowledged entry present; 0 corrupt")
    store = f"disk://{work / 'disk'}"
    acked: dict[str, str] = {}
    statuses: Counter[int] = Counter()
    with children() as procs:
        proxy = in_process_proxy(procs, work, "--store", store)

        async def burst() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                counter = iter(range(10**9))

                async def worker() -> None:
                    while True:
                        prompt = f"Tell me about the owl. ({next(counter)})"
                        status, _, data = await post(s, proxy.url, chat(prompt))
                        statuses[status] += 1
                        if status == 200:
                            acked[prompt] = content(data) or ""
                        elif status == 0:
                            return  # the proxy is gone

                await asyncio.gather(*(worker() for _ in range(16)))

        async def kill_later() -> None:
            await asyncio.sleep(args.fault_seconds / 2)
            proxy.kill(signal.SIGKILL)

        async def both() -> None:
            await asyncio.gather(burst(), kill_later())

        asyncio.run(both())
        port = int(proxy.url.rsplit(":")[-1])
        proxy = in_process_proxy(procs, work, "--store", store, port=port)

        async def check() -> list[tuple[str, int, str, bytes]]:
            async with aiohttp.ClientSession() as s:
                return [(p, *await post(s, proxy.url, chat(p))) for p in acked]

        after = asyncio.run(check())
    out.sent = sum(statuses.values())
    out.succeeded = statuses[200]
    out.failed = out.sent - out.succeeded
    out.lost = sum(1 for a in after if a[2] != "HIT")
    out.corrupt = sum(1 for a in after if a[1] != 200 or (a[2] == "HIT" and content(a[3])
                                                           != acked[a[0]]))
    out.caches = dict(Counter(a[2] for a in after))
    out.notes = (f"SIGKILL after {args.fault_seconds / 2:g} s of a 16-client burst of new "
                 f"prompts; failed = in flight at the kill; {len(acked)} acknowledged entries "
                 "re-read after the restart")
    out.ok = out.lost == 0 and out.corrupt == 0
    return out


def runner_killed(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("runner-killed", expected="clean 502s; 0 partial entries; recovery")
    long = {"max_tokens": args.long_tokens, "logit_bias": NO_EOS}
    with children() as procs:
        model_dir = demo_model(work)
        up = start_upstream(procs, work, model_dir)
        proxy = start_proxy(procs, work, "--upstream", up.url, "--model-dir", str(model_dir),
                            "--model-id", "demo", "--store", "memory://",
                            "--upstream-timeout", "5", "--max-tokens-cap", "4096")
        prompts = [f"Once upon a time, the owl ({i})" for i in range(args.victims)]

        async def victims() -> list[tuple[int, str, bytes]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

                async def killer() -> None:
                    await asyncio.sleep(0.5)
                    up.kill(signal.SIGKILL)

                kill = asyncio.create_task(killer())
                answers = await asyncio.gather(*(post(s, proxy.url, chat(p, **long))
                                                  for p in prompts))
                await kill
                return list(answers)

        answers = asyncio.run(victims())
        t_restart = time.monotonic()
        procs.restart(up)

        async def recover() -> tuple[float, list[tuple[int, str, bytes]]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    status, _, _ = await post(s, proxy.url, chat("What does the cat eat?"))
                    if status == 200:
                        break
                    await asyncio.sleep(0.2)
                took = time.monotonic() - t_restart
                again = [await post(s, proxy.url, chat(p, max_tokens=8, logit_bias=NO_EOS))
                         for p in prompts]
                partial = [await post(s, proxy.url, chat(p, **long)) for p in prompts[:3]]
                return took, again + partial

        recovered_s, after = asyncio.run(recover())
    statuses = Counter(a[0] for a in answers)
    out.sent = len(answers)
    out.succeeded = statuses[200]
    out.failed = out.sent - out.succeeded
    bad_errors = sum(1 for a in answers if a[0] not in (200, 502, 504)
                     or (a[0] != 200 and b'"error"' not in a[2]))
    # The long prompts must generate again (MISS), never be served from a partial entry.
    out.lost = 0
    out.corrupt = sum(1 for a in after[len(prompts):] if a[1] == "HIT")
    out.caches = dict(Counter(a[1] for a in after))
    out.extra = {"victim_statuses": dict(statuses), "non_clean_errors": bad_errors,
                 "recovery_s": round(recovered_s, 2)}
    out.notes = (f"{len(prompts)} concurrent {args.long_tokens}-token generations, upstream "
                 f"SIGKILLed after 0.5 s; statuses {dict(statuses)}; first 200 "
                 f"{recovered_s:.1f} s after the restart began; corrupt = partial entry served")
    out.ok = bad_errors == 0 and out.corrupt == 0 and all(a[0] == 200 for a in after)
    return out


def disconnects(work: Path, args: argparse.Namespace) -> Outcome:
    with children() as procs:
        proxy = in_process_proxy(procs, work, "--store", "memory://", "--queue-size", "1024")
        return asyncio.run(disconnect_storm(proxy.url, args.storm, args.storm_tokens))


async def disconnect_storm(url: str, storm: int, tokens: int, model: str = "demo"
                           ) -> Outcome:
    """The disconnects scenario against a proxy at `url` (the suite runs it in-process):
    `storm` streaming clients, two per prompt, hang up after the first chunk; every fill
    they started must complete and be stored."""
    out = Outcome("disconnects", expected="every started fill completed and stored")
    prompts = [f"Once upon a time, the fox ({i})" for i in range(storm // 2)]
    body = {"model": model, "max_tokens": tokens, "logit_bias": NO_EOS, "stream": True}
    started: Counter[str] = Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def client(i: int) -> None:  # two clients per prompt: a MISS + a follower
            try:
                async with s.post(url + PATH, json=chat(prompts[i % len(prompts)], **body)) as r:
                    await r.content.readany()
                    started[r.headers.get("X-Cache", "-").split(";")[0]] += 1
            except (aiohttp.ClientError, TimeoutError):
                started["ERROR"] += 1
            # leaving the block without reading on closes the connection mid-stream

        await asyncio.gather(*(client(i) for i in range(storm)))

    after: list[tuple[int, str, bytes]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        deadline = time.monotonic() + 120
        for p in prompts:  # wait out fills still running (COALESCED), then want HIT
            while True:
                answer = await post(s, url, chat(p, **(body | {"stream": False})))
                if answer[1] != "COALESCED" or time.monotonic() > deadline:
                    break
            after.append(answer)
    out.sent = storm
    out.succeeded = sum(v for k, v in started.items() if k != "ERROR")
    out.failed = started["ERROR"]
    out.lost = sum(1 for a in after if a[1] not in ("HIT", "COALESCED"))
    out.corrupt = sum(1 for a in after if a[0] != 200)
    out.caches = dict(Counter(a[1] for a in after))
    out.extra = {"first_chunk_x_cache": dict(started)}
    out.notes = (f"{storm} streaming clients on {len(prompts)} prompts ({tokens} tokens each) "
                 "disconnect after the first chunk; lost = prompt not stored when asked again")
    out.ok = out.lost == 0 and out.corrupt == 0
    return out


def hostile_requests(work: Path, args: argparse.Namespace) -> Outcome:
    with children() as procs:
        proxy = in_process_proxy(procs, work, "--store", "memory://", "--max-tokens-cap", "8",
                                 "--default-max-tokens", "8", "--max-body-bytes", "65536")
        return hostile_against(proxy.url, args.hostile,
                               alive=lambda: proxy.proc.poll() is None)


def hostile_against(url: str, n: int, *, alive: Callable[[], bool] = lambda: True,
                    model: str = "demo") -> Outcome:
    """The hostile scenario against a proxy at `url` (blocking: raw sockets; the suite runs
    it in a thread against an in-process proxy): n hostile or malformed requests, then the
    server must be alive and answer /health and a valid chat."""
    out = Outcome("hostile", expected="0 responses 5xx; alive afterwards")
    port = int(url.rsplit(":")[-1])
    counts = hostile.run_all(port, n, deadline=time.monotonic() + 600)
    is_alive = alive()
    health = hostile.status_of(port, "GET", "/health", b"")
    valid = json.dumps(chat("What does the fox eat?", max_tokens=4, model=model)).encode()
    works = hostile.status_of(port, "POST", PATH, valid)
    out.sent = counts.total
    out.succeeded = counts.total - counts.server_errors - counts.dropped
    out.failed = counts.server_errors + counts.dropped
    out.caches = {str(k): v for k, v in sorted(counts.statuses.items())}
    out.extra = {"kinds": dict(counts.kinds), "dropped_by_kind": dict(counts.dropped_kinds),
                 "examples_5xx": counts.examples[:5],
                 "health_after": health, "chat_after": works, "alive": is_alive}
    out.notes = (f"statuses {out.caches}; failed = 5xx ({counts.server_errors}) + no response "
                 f"({counts.dropped}: {dict(counts.dropped_kinds)}); afterwards /health "
                 f"{health}, chat {works}")
    out.ok = counts.server_errors == 0 and is_alive and health == 200 and works == 200
    return out


def proc_usage(pid: int) -> tuple[float, int]:
    """(VmRSS MiB, open file descriptors) of a process."""
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def soak(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("soak", expected="no steady RSS or fd growth after warm-up")
    seconds = args.soak_seconds
    warm = max(2.0, min(60.0, seconds / 5))
    with children() as procs:
        proxy = in_process_proxy(procs, work, "--store", "memory://")
        samples: list[tuple[float, float, int]] = []
        prompts = [f"Where does the bear live? ({i})" for i in range(args.pool)]

        def body(i: int) -> dict[str, Any]:  # hits on a fixed pool, some streamed
            return chat(prompts[i % len(prompts)], stream=i % 4 == 0)

        t0 = time.monotonic()
        events = [(t, lambda: samples.append((time.monotonic() - t0,
                                              *proc_usage(proxy.pid))))
                  for t in [warm] + [warm + k * (seconds - warm) / 20 for k in range(1, 21)]]
        events[-1] = (seconds - 0.2, events[-1][1])
        statuses, caches = asyncio.run(closed_loop(proxy.url, body, 8, seconds, events))
    (_, rss_w, fd_w), (_, rss_e, fd_e) = samples[0], samples[-1]
    out.sent = sum(statuses.values())
    out.succeeded = statuses[200]
    out.failed = out.sent - out.succeeded
    out.caches = dict(caches)
    out.extra = {"samples": samples, "rss_warm_mib": round(rss_w, 1), "rss_end_mib": round(
        rss_e, 1), "fds_warm": fd_w, "fds_end": fd_e, "warmup_s": warm}
    growth = rss_e - rss_w
    out.notes = (f"{seconds:g} s at 8 connections over {len(prompts)} prompts (1 in 4 streamed);"
                 f" VmRSS {rss_w:.1f} MiB after {warm:g} s warm-up -> {rss_e:.1f} MiB at the "
                 f"end ({growth:+.1f} MiB, {growth / rss_w:+.1%}); fds {fd_w} -> {fd_e}")
    out.ok = out.failed == 0 and fd_e <= fd_w + 4 and growth <= max(16.0, 0.1 * rss_w)
    return out


def slowloris(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("slowloris", expected=">= 99 % answered, p99 < 100 ms")
    import contextlib
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.slowloris + 256
    if soft < want:  # this process holds every trickling socket
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
    body = chat("Tell me about the fox.", max_tokens=8)
    with children() as procs:
        # (all from loopback: the per-address bound as high, so the shared bound is tried)
        proxy = in_process_proxy(procs, work, "--store", "memory://",
                                 "--max-connections", str(args.slowloris),
                                 "--max-connections-per-peer", str(args.slowloris))
        port = int(proxy.url.rsplit(":", 1)[1])

        async def run() -> tuple[list[float], int]:
            async with aiohttp.ClientSession() as s:  # the answer stored: the rest are HITs
                await post(s, proxy.url, body)
            trickling = []
            for _ in range(args.slowloris):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(head)
                sock.setblocking(False)
                trickling.append(sock)
            stop = asyncio.Event()

            async def trickle() -> None:  # a byte per socket every 2 s, never the end
                while not stop.is_set():
                    for sock in trickling:
                        with contextlib.suppress(OSError):  # closed by the server
                            sock.send(b"a")
                    await asyncio.sleep(2)

            task = asyncio.create_task(trickle())
            await asyncio.sleep(1)
            times, failed = [], 0
            connector = aiohttp.TCPConnector(force_close=True)  # a new connection each
            async with aiohttp.ClientSession(connector=connector) as s:
                for _ in range(100):
                    started = time.monotonic()
                    status, _, _ = await post(s, proxy.url, body)
                    if status == 200:
                        times.append(time.monotonic() - started)
                    else:
                        failed += 1
            stop.set()
            await task
            for sock in trickling:
                sock.close()
            return times, failed

        times, failed = asyncio.run(run())
    out.sent, out.succeeded, out.failed = 100, len(times), failed
    p99 = sorted(times)[max(0, int(len(times) * 0.99) - 1)] * 1000 if times else float("inf")
    out.extra = {"p50_ms": round(sorted(times)[len(times) // 2] * 1000, 2) if times else None,
                 "p99_ms": round(p99, 2), "trickling": args.slowloris}
    out.notes = (f"{args.slowloris} connections trickling headers; normal client p50 "
                 f"{out.extra['p50_ms']} ms, p99 {out.extra['p99_ms']} ms")
    out.ok = len(times) >= 99 and p99 < 100
    return out


def schema_flood(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("schema-flood", expected="HIT median < 50 ms under the flood")
    with children() as procs:
        proxy = in_process_proxy(procs, work, "--store", "memory://", "--max-schema-bytes",
                                 str(1 << 20), "--max-schema-properties", "20000",
                                 "--schema-timeout", "600")
        flood = asyncio.run(hostile_load.schema_flood_against(
            proxy.url, properties=args.flood_properties, flooders=args.flooders,
            seconds=args.flood_seconds))
    out.sent = len(flood.hit_ms) + sum(flood.flood_statuses.values())
    out.succeeded = len(flood.hit_ms)
    out.caches = {str(k): v for k, v in sorted(flood.flood_statuses.items())}
    out.extra = {"hit_median_ms": round(flood.median_ms, 2),
                 "hit_p99_ms": round(hostile_load.percentile(flood.hit_ms, 0.99), 2),
                 "hits": len(flood.hit_ms), "flood_statuses": out.caches}
    out.notes = (f"{args.flooders} clients x {args.flood_properties}-property response_format "
                 f"for {args.flood_seconds:g} s (statuses {out.caches}: 504 = parsed); HIT "
                 f"median {out.extra['hit_median_ms']} ms, p99 {out.extra['hit_p99_ms']} ms "
                 f"over {len(flood.hit_ms)} HITs")
    out.ok = flood.median_ms < 50 and flood.flood_statuses[504] >= 1
    return out


def regex_bombs(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("regex-bombs", expected="every bomb a 400 schema_too_complex, RSS < +200 MB")
    with children() as procs:
        proxy = in_process_proxy(procs, work, "--store", "memory://")
        codes, before, after = asyncio.run(hostile_load.regex_bombs_against(
            proxy.url, lambda: proc_usage(proxy.proc.pid)[0], bombs=args.bombs))
    out.sent = sum(codes.values())
    out.succeeded = codes["400:schema_too_complex"]
    out.failed = out.sent - out.succeeded
    out.caches = dict(codes)
    out.extra = {"rss_before_mib": round(before, 1), "rss_after_mib": round(after, 1),
                 "rss_growth_mib": round(after - before, 1), "bombs": args.bombs}
    out.notes = (f"{args.bombs} distinct regex bombs: {dict(codes)}; RSS {before:.0f} -> "
                 f"{after:.0f} MiB ({after - before:+.0f})")
    out.ok = out.failed == 0 and after - before < 200
    return out


def slow_bodies(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("slow-bodies", expected=">= 95 % fresh served, every keep-alive one")
    # As the probe (the connections the server closes stay closed); the same with no
    # rate floor and no bound on bodies arriving (held 10 s: the connection guard makes the
    # room); and an attacker that opens again every connection closed (a connection flood).
    variants = {"held": (False, ()),
                "held, guard only": (False, ("--body-min-rate", "0",
                                             "--max-body-connections", "100000")),
                "reopening": (True, ())}
    runs = {}
    for name, (reopen, flags) in variants.items():
        with children() as procs:
            proxy = in_process_proxy(procs, work, "--store", "memory://", "--max-connections",
                                     str(args.slow_bodies), "--max-connections-per-peer",
                                     str(args.slow_bodies), *flags)  # (all from loopback)
            runs[name] = hostile_load.slow_bodies_against(proxy.url, slow=args.slow_bodies,
                                                          reopen=reopen)
    out.sent = sum(r.fresh_sent + r.keep_alive_sent for r in runs.values())
    out.succeeded = sum(len(r.fresh_ms) + r.keep_alive_served for r in runs.values())
    out.failed = out.sent - out.succeeded
    out.extra = {name: {
        "fresh_share": round(r.fresh_share, 3),
        "fresh_p50_ms": round(hostile_load.percentile(r.fresh_ms, 0.5), 2),
        "fresh_p99_ms": round(hostile_load.percentile(r.fresh_ms, 0.99), 2),
        "fresh_statuses": dict(r.fresh_statuses),
        "keep_alive": f"{r.keep_alive_served}/{r.keep_alive_sent}",
        "slow_reopened": r.reopened, "server_connections": r.connections}
        for name, r in runs.items()}
    out.notes = "; ".join(
        f"{name}: fresh {len(r.fresh_ms)}/{r.fresh_sent} served (p50 "
        f"{out.extra[name]['fresh_p50_ms']} ms, p99 {out.extra[name]['fresh_p99_ms']} ms), "
        f"keep-alive {out.extra[name]['keep_alive']}, {r.reopened} reopened, guard "
        f"{r.connections}" for name, r in runs.items())
    out.notes = f"{args.slow_bodies} slow-body connections, a byte every 3 s: {out.notes}"
    out.ok = all(r.fresh_share >= 0.95 and r.keep_alive_served == r.keep_alive_sent
                 for r in runs.values())
    return out


async def ask(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
              ) -> tuple[int, str, bytes]:
    """As `post`, with the whole X-Cache header (its reason too)."""
    try:
        async with session.post(url + PATH, json=body) as resp:
            return resp.status, resp.headers.get("X-Cache", "-"), await resp.read()
    except (aiohttp.ClientError, TimeoutError):
        return 0, "ERROR", b""


def p99_ms(times: list[float]) -> float:
    """The 99th percentile in ms, as slowloris reports it."""
    return sorted(times)[max(0, int(len(times) * 0.99) - 1)] * 1000 if times else float("inf")


def metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of the proxy's /metrics, None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http("GET", url + "/metrics")[2].decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def tcp_kernel_mib() -> float:
    """Memory the kernel holds in TCP socket buffers, all sockets (/proc/net/sockstat)."""
    for line in Path("/proc/net/sockstat").read_text().splitlines():
        if line.startswith("TCP:"):
            fields = line.split()
            return int(fields[fields.index("mem") + 1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return float("nan")


def unread(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("unread", expected="RSS growth < 1 MiB per unread client; HIT p99 < 50 ms")
    import socket

    big = chat("Tell me about the fox.", n=args.unread_n, max_tokens=args.unread_tokens,
               logprobs=True, top_logprobs=20, logit_bias=NO_EOS)
    raw = json.dumps(big).encode()
    request = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (PATH.encode(), len(raw), raw))
    small = chat("What does the fox eat?", max_tokens=8)
    with children() as procs:
        proxy = in_process_proxy(procs, work, "--store", "memory://")
        port = int(proxy.url.rsplit(":", 1)[1])

        async def run() -> dict[str, Any]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
                primed = [await post(s, proxy.url, big) for _ in range(2)]  # MISS, then HIT
                await post(s, proxy.url, small)
            if [p[1] for p in primed] != ["MISS", "HIT"]:
                raise BenchError(f"the large answer was not stored: {[p[:2] for p in primed]}")
            before = proc_usage(proxy.pid)[0]
            socks = []
            for _ in range(args.unread):  # each asks, and never reads past its 4 KiB buffer
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", port))
                sock.sendall(request)
                socks.append(sock)
            answered = 0
            for sock in socks:  # the status line arrived (peeked: still unread)
                sock.settimeout(60)
                answered += sock.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"
            peak, kernel = proc_usage(proxy.pid)[0], tcp_kernel_mib()
            times, failed = [], 0
            async with aiohttp.ClientSession() as s:  # one keep-alive connection
                for _ in range(100):
                    started = time.monotonic()
                    status, cache, _ = await post(s, proxy.url, small)
                    if status == 200 and cache == "HIT":
                        times.append(time.monotonic() - started)
                    else:
                        failed += 1
                    peak = max(peak, proc_usage(proxy.pid)[0])
            held = proc_usage(proxy.pid)[0]
            for sock in socks:
                sock.close()
            await asyncio.sleep(1.0)
            after = proc_usage(proxy.pid)[0]
            connections = json.loads(http("GET", proxy.url + "/health")[2])["connections"]
            return {"answer_bytes": len(primed[1][2]), "answered": answered, "times": times,
                    "failed": failed, "rss_before_mib": round(before, 1),
                    "rss_peak_mib": round(peak, 1), "rss_held_mib": round(held, 1),
                    "rss_after_mib": round(after, 1), "send_timeouts":
                    connections.get("send_timeouts"), "tcp_kernel_held_mib": round(kernel, 1)}

        figures = asyncio.run(run())
    times = figures.pop("times")
    out.sent, out.succeeded, out.failed = 100, len(times), figures.pop("failed")
    growth = figures["rss_peak_mib"] - figures["rss_before_mib"]
    out.extra = {**figures, "unread": args.unread, "p50_ms": round(
        sorted(times)[len(times) // 2] * 1000, 2) if times else None,
        "p99_ms": round(p99_ms(times), 2), "growth_per_client_mib": round(
        growth / args.unread, 3)}
    out.notes = (f"{args.unread} clients left a {figures['answer_bytes'] / 1e6:.1f} MB HIT "
                 f"unread ({figures['answered']} began); VmRSS {figures['rss_before_mib']} MiB "
                 f"before, peak {figures['rss_peak_mib']}, {figures['rss_after_mib']} after "
                 f"they hung up ({growth:+.1f} MiB, {growth / args.unread:.3f} MiB per client);"
                 f" HITs meanwhile p50 {out.extra['p50_ms']} ms, p99 {out.extra['p99_ms']} ms;"
                 f" the kernel's TCP buffers held {figures['tcp_kernel_held_mib']} MiB")
    out.ok = (figures["answered"] == args.unread and len(times) >= 99
              and p99_ms(times) < 50 and growth < args.unread)
    return out


def _mount_failed(out: Outcome, exc: MountImpossible) -> Outcome:
    print(f"  {out.scenario}: not run: {exc}", file=sys.stderr, flush=True)
    out.notes, out.ok = f"not run: {exc}", False
    return out


async def _store_until_refused(url: str, limit: int, **extra: Any
                               ) -> tuple[dict[str, str | None], list[tuple[int, str]]]:
    """New prompts until one is not stored: (stored prompt -> answer, (status, X-Cache) of
    every answer)."""
    stored: dict[str, str | None] = {}
    answers = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for i in range(limit):
            prompt = f"Tell me about the owl. ({i})"
            status, cache, data = await ask(s, url, chat(prompt, **extra))
            answers.append((status, cache))
            if cache != "MISS":
                break
            stored[prompt] = content(data)
    return stored, answers


async def _again(url: str, prompts: list[str], **extra: Any) -> list[tuple[int, str, bytes]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        return [await ask(s, url, chat(p, **extra)) for p in prompts]


def _reread(out: Outcome, stored: dict[str, str | None],
            answers: list[tuple[int, str, bytes]]) -> None:
    """lost = stored entries not a HIT; corrupt = a HIT whose answer is not the stored one."""
    out.lost += sum(1 for a in answers if a[1] != "HIT")
    out.corrupt += sum(1 for a, first in zip(answers, stored.values(), strict=True)
                       if a[1] == "HIT" and content(a[2]) != first)


def disk_full(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("disk-full", expected="every stored entry a HIT; new: MISS; reason=store-full")
    entry = {"max_tokens": 32, "logprobs": True, "top_logprobs": 5}  # entries of ~10 KB
    try:
        with broken_disks.tmpfs(work / "tiny") as tiny, children() as procs:
            proxy = in_process_proxy(procs, work, "--store", f"disk://{tiny}")
            junk = broken_disks.fill(tiny, leave=args.disk_room)
            stored, filling = asyncio.run(_store_until_refused(proxy.url, 2000, **entry))
            free = broken_disks.free_bytes(tiny)
            new = asyncio.run(_again(proxy.url, [f"What does the duck eat? ({i})"
                                                 for i in range(args.pool)], **entry))
            again = asyncio.run(_again(proxy.url, list(stored), **entry))
            refused = metric(proxy.url, "cacheproxy_store_writes_refused", reason="store-full")
            breaker = metric(proxy.url, "cacheproxy_store_breaker_open")
    except MountImpossible as exc:
        return _mount_failed(out, exc)
    full = "MISS; reason=store-full"
    answers = [*filling, *((a[0], a[1]) for a in new + again)]
    out.sent = len(answers)
    out.succeeded = sum(1 for a in answers if a[0] == 200)
    out.failed = out.sent - out.succeeded
    _reread(out, stored, again)
    out.caches = dict(Counter(a[1] for a in answers))
    refused_new = sum(1 for a in new if a[1] == full)
    out.extra = {"junk_bytes": junk, "stored": len(stored), "free_bytes_at_refusal": free,
                 "new_refused": refused_new, "writes_refused_metric": refused,
                 "breaker_open": breaker}
    out.notes = (f"1 MB tmpfs: {junk // 1024} KiB of junk, then {len(stored)} entries until "
                 f"the store refused one ({free} bytes free); {len(stored)} re-read; "
                 f"{refused_new}/{len(new)} new prompts '{full}'; "
                 f"cacheproxy_store_writes_refused {refused}; breaker open {breaker}")
    out.ok = (len(stored) > 0 and filling[-1][1] == full and out.lost == 0 and out.corrupt == 0
              and refused_new == len(new) and out.failed == 0 and breaker == 0)
    return out


async def _until_stored(url: str, within: float) -> tuple[float | None, list[str]]:
    """A new prompt every 0.25 s until one is stored (a plain MISS, then a HIT): the seconds
    that took (None: not within `within`), and the X-Cache of each try."""
    started, caches = time.monotonic(), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for i in range(int(within / 0.25)):
            body = chat(f"What does the hen eat? ({i})")
            caches.append((await ask(s, url, body))[1])
            if caches[-1] == "MISS" and (await ask(s, url, body))[1] == "HIT":
                return time.monotonic() - started, caches
            await asyncio.sleep(0.25)
    return None, caches


def disk_full_restart(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("disk-full-restart", expected="restarted full: stored HIT, new store-full; "
                  "room again: stored again")
    store = "disk://{}"
    try:
        # (8 MB: room for the entries and their WAL, which a clean stop folds into the file)
        with broken_disks.tmpfs(work / "tiny", size="8m") as tiny:
            with children() as procs:  # a writer stores, and stops cleanly (no WAL left)
                writer = in_process_proxy(procs, work, "--store", store.format(tiny))
                stored, _ = asyncio.run(_store_until_refused(writer.url, args.pool))
                writer.kill(signal.SIGTERM)
            left = sorted(p.name for p in tiny.iterdir())
            junk = broken_disks.fill(tiny)
            with children() as procs:
                proxy = in_process_proxy(procs, work, "--store", store.format(tiny))
                again = asyncio.run(_again(proxy.url, list(stored)))
                new = asyncio.run(_again(proxy.url, [f"What does the duck eat? ({i})"
                                                     for i in range(args.pool)]))
                logged = "disk_store_full" in proxy.log.read_text(errors="replace")
                (tiny / "junk").unlink()
                healed_s, healing = asyncio.run(_until_stored(proxy.url, within=30.0))
                breaker = metric(proxy.url, "cacheproxy_store_breaker_open")
                errors = metric(proxy.url, "cacheproxy_store_errors")
    except MountImpossible as exc:
        return _mount_failed(out, exc)
    full = "MISS; reason=store-full"
    answers = again + new
    out.sent = len(answers) + len(healing)
    out.succeeded = sum(1 for a in answers if a[0] == 200) + \
        sum(1 for c in healing if c.startswith(("MISS", "HIT")))
    out.failed = out.sent - out.succeeded
    _reread(out, stored, again)
    out.caches = dict(Counter([*(a[1] for a in answers), *healing]))
    refused_new = sum(1 for a in new if a[1] == full)
    out.extra = {"stored": len(stored), "files_after_stop": left, "junk_bytes": junk,
                 "new_refused": refused_new, "logged_full": logged, "healed_s": healed_s,
                 "tries_to_heal": len(healing), "breaker_open": breaker,
                 "store_errors": errors}
    healed = "never" if healed_s is None else f"{healed_s:.1f} s, {len(healing)} tries"
    out.notes = (f"{len(stored)} entries stored, stopped ({', '.join(left)} left), "
                 f"{junk // 1024} KiB of junk, restarted: re-read {len(again)}, "
                 f"{refused_new}/{len(new)} new '{full}', disk_store_full logged {logged}; "
                 f"junk removed: a new answer stored again after {healed}; breaker open "
                 f"{breaker}, store errors {errors}")
    out.ok = (out.failed == 0 and out.lost == 0 and out.corrupt == 0 and logged
              and refused_new == len(new) and healed_s is not None and breaker == 0
              and errors == 0)
    return out


def read_only(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("read-only", expected="stored entries HIT; new: MISS; reason=store-read-only")
    store = "disk://{}"
    try:
        with broken_disks.tmpfs(work / "ro", size="8m") as ro:
            with children() as procs:  # a writer stores, and stops cleanly
                writer = in_process_proxy(procs, work, "--store", store.format(ro))
                stored, _ = asyncio.run(_store_until_refused(writer.url, args.pool))
                writer.kill(signal.SIGTERM)
            broken_disks.remount(ro, "ro")
            with children() as procs:
                reader = in_process_proxy(procs, work, "--store", store.format(ro))
                again = asyncio.run(_again(reader.url, list(stored)))
                new = asyncio.run(_again(reader.url, [f"What does the duck eat? ({i})"
                                                      for i in range(args.pool)]))
                alive = reader.proc.poll() is None
                logged = "disk_store_read_only" in reader.log.read_text(errors="replace")
            broken_disks.remount(ro, "rw")  # a writer killed: the last entries in its WAL
            with children() as procs:
                writer = in_process_proxy(procs, work, "--store", store.format(ro))
                wal_only = asyncio.run(_again(writer.url, [f"What does the cat eat? ({i})"
                                                           for i in range(args.pool)]))
                writer.kill(signal.SIGKILL)
            broken_disks.remount(ro, "ro")
            with children() as procs:
                reader = in_process_proxy(procs, work, "--store", store.format(ro))
                after_kill = asyncio.run(_again(reader.url, [f"What does the cat eat? ({i})"
                                                             for i in range(args.pool)]))
                again_after_kill = asyncio.run(_again(reader.url, list(stored)))
    except MountImpossible as exc:
        return _mount_failed(out, exc)
    read_only_miss = "MISS; reason=store-read-only"
    answers = again + new + after_kill + again_after_kill
    out.sent = len(answers)
    out.succeeded = sum(1 for a in answers if a[0] == 200)
    out.failed = out.sent - out.succeeded
    _reread(out, stored, again)
    _reread(out, stored, again_after_kill)
    wal_hits = sum(1 for a in after_kill if a[1] == "HIT")
    out.corrupt += sum(1 for a, b in zip(after_kill, wal_only, strict=True)
                       if a[1] == "HIT" and content(a[2]) != content(b[2]))
    out.caches = dict(Counter(a[1] for a in answers))
    refused_new = sum(1 for a in new if a[1] == read_only_miss)
    out.extra = {"stored": len(stored), "new_refused": refused_new, "alive": alive,
                 "logged_read_only": logged, "wal_only_entries": len(wal_only),
                 "wal_only_hits": wal_hits}
    out.notes = (f"{len(stored)} entries stored, tmpfs remounted ro: re-read {len(again)}, "
                 f"{refused_new}/{len(new)} new '{read_only_miss}', alive {alive}, "
                 f"disk_store_read_only logged {logged}; then {len(wal_only)} more stored by a "
                 f"writer SIGKILLed (in its WAL) and remounted ro: {wal_hits}/{len(wal_only)} "
                 f"HIT, the first {len(stored)} re-read again")
    out.ok = (out.failed == 0 and out.lost == 0 and out.corrupt == 0 and alive and logged
              and refused_new == len(new))
    return out


def corrupt_db(work: Path, args: argparse.Namespace) -> Outcome:
    out = Outcome("corrupt", expected="all answered; quarantined, healed; 0 wrong served")
    directory = work / "store"
    database = directory / broken_disks.DB_FILENAME
    prompts = [f"Where does the {a} live? ({i})" for i, a in
               enumerate(["fox", "owl", "cat", "dog", "bear"] * (args.pool // 5 or 1))]
    with children() as procs:
        proxy = in_process_proxy(procs, work, "--store", f"disk://{directory}")
        first = asyncio.run(_again(proxy.url, prompts))
        expected = {p: content(a[2]) for p, a in zip(prompts, first, strict=True)}
        broken_disks.checkpoint(database)
        damaged = [broken_disks.corrupt(database, seed=1)]  # under the serving proxy
        during = asyncio.run(_again(proxy.url, prompts))
        healed = asyncio.run(_again(proxy.url, prompts))
        quarantined_serving = len(broken_disks.quarantined(directory))
        proxy.kill(signal.SIGTERM)  # (a clean stop: the pages leave the WAL)
        damaged.append(broken_disks.corrupt(database, seed=2))  # then started on it
        proxy = procs.restart(proxy)
        at_start = asyncio.run(_again(proxy.url, prompts))
        healed_again = asyncio.run(_again(proxy.url, prompts))
        quarantined = len(broken_disks.quarantined(directory))
        logged = proxy.log.read_text(errors="replace").count("disk_store_quarantined")
    answers = during + healed + at_start + healed_again
    out.sent = len(answers)
    out.succeeded = sum(1 for a in answers if a[0] == 200)
    out.failed = out.sent - out.succeeded
    out.corrupt = sum(1 for a, p in zip(answers, prompts * 4, strict=True)
                      if a[0] == 200 and content(a[2]) != expected[p])
    out.lost = sum(1 for a in healed + healed_again if a[1] != "HIT")
    out.caches = dict(Counter(a[1] for a in answers))
    out.extra = {"entries": len(prompts), "damaged_bytes": damaged, "quarantined": quarantined,
                 "quarantined_while_serving": quarantined_serving, "log_lines": logged,
                 "during": dict(Counter(a[1] for a in during)),
                 "at_start": dict(Counter(a[1] for a in at_start))}
    out.notes = (f"{len(prompts)} entries; pages overwritten ({damaged[0] // 1024} KiB) under "
                 f"the serving proxy: next asks {out.extra['during']}, then "
                 f"{dict(Counter(a[1] for a in healed))}; again while stopped "
                 f"({damaged[1] // 1024} KiB), restarted: {out.extra['at_start']}, then "
                 f"{dict(Counter(a[1] for a in healed_again))}; {quarantined} files "
                 "quarantined; wrong = an answer not the one first generated")
    out.ok = (out.failed == 0 and out.corrupt == 0 and out.lost == 0
              and quarantined_serving >= 1 and quarantined >= 2)
    return out


SCENARIOS: dict[str, Callable[[Path, argparse.Namespace], Outcome]] = {
    "redis-restart": redis_restart, "proxy-sigkill": proxy_sigkill,
    "runner-killed": runner_killed, "disconnects": disconnects, "hostile": hostile_requests,
    "soak": soak, "slowloris": slowloris, "unread": unread, "disk-full": disk_full,
    "schema-flood": schema_flood, "regex-bombs": regex_bombs, "slow-bodies": slow_bodies,
    "disk-full-restart": disk_full_restart, "read-only": read_only, "corrupt": corrupt_db,
}


def markdown(outcomes: list[Outcome]) -> str:
    rows = [[o.scenario, o.sent, o.succeeded, o.failed, o.lost, o.corrupt,
             "yes" if o.ok else "**no**", o.expected, o.notes] for o in outcomes]
    return table(["scenario", "sent", "succeeded", "failed", "entries lost", "entries corrupt",
                  "as expected", "expected", "notes"], rows, "l______ll")


def plot(outcomes: list[Outcome], args: argparse.Namespace) -> Path | None:
    soaked = next((o for o in outcomes if o.scenario == "soak"), None)
    if soaked is None:
        return None
    fig, axes = figure(1, 1, (8, 4))
    ax = axes[0][0]
    ts = [s[0] for s in soaked.extra["samples"]]
    ax.plot(ts, [s[1] for s in soaked.extra["samples"]], "o-", label="VmRSS MiB")
    ax.set_xlabel("seconds")
    ax.set_ylabel("VmRSS MiB")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(ts, [s[2] for s in soaked.extra["samples"]], "s--", color="tab:orange",
             label="open fds")
    ax2.set_ylabel("open file descriptors")
    ax2.set_ylim(bottom=0)
    ax.set_title(f"cacheproxy soak: {args.soak_seconds:g} s at 8 connections")
    ax.legend(loc="lower left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    return save(fig, args.out / "faults.png")


def main(args: argparse.Namespace) -> int:
    print(f"runtime: {runtime_line()}", file=sys.stderr)
    outcomes = []
    for name in args.only:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"lt_{name}_") as tmp:
            o = SCENARIOS[name](Path(tmp), args)
        o.extra["seconds"] = round(time.monotonic() - t0, 1)
        print(f"  {name}: ok={o.ok} sent {o.sent} succeeded {o.succeeded} failed {o.failed} "
              f"lost {o.lost} corrupt {o.corrupt} ({o.extra['seconds']} s) {o.notes}",
              file=sys.stderr, flush=True)
        outcomes.append(o)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults.json").write_text(json.dumps(
        {"runtime": runtime_line(), "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    plot(outcomes, args)
    print(markdown(outcomes))
    return 0 if all(o.ok for o in outcomes) else 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    p.add_argument("--soak-seconds", type=float, default=600.0)
    p.add_argument("--fault-seconds", type=float, default=9.0,
                   help="length of the redis-restart load and proxy-sigkill burst window")
    p.add_argument("--hostile", type=int, default=10_000, help="hypothesis-generated requests")
    p.add_argument("--pool", type=int, default=50, help="prompts in the hit pool")
    p.add_argument("--victims", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=480,
                   help="tokens per killed generation (the demo model's context is 512)")
    p.add_argument("--storm", type=int, default=100, help="disconnecting streaming clients")
    p.add_argument("--storm-tokens", type=int, default=64)
    p.add_argument("--slowloris", type=int, default=1000, help="connections trickling headers")
    p.add_argument("--flooders", type=int, default=2, help="clients flooding schemas")
    p.add_argument("--bombs", type=int, default=50, help="regex-bomb schemas sent")
    p.add_argument("--flood-properties", type=int, default=10_000,
                   help="properties of the flooding response_format")
    p.add_argument("--flood-seconds", type=float, default=20.0)
    p.add_argument("--slow-bodies", type=int, default=1000,
                   help="connections trickling their bodies (also --max-connections)")
    p.add_argument("--unread", type=int, default=100, help="clients that never read")
    p.add_argument("--unread-n", type=int, default=16, help="choices of the unread answer")
    p.add_argument("--unread-tokens", type=int, default=500, help="tokens of the unread answer")
    p.add_argument("--disk-room", type=int, default=384 << 10,
                   help="bytes the junk file leaves free on the 1 MB tmpfs for entries")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds each")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.smoke:
        args.soak_seconds, args.fault_seconds, args.hostile, args.pool = 4.0, 3.0, 150, 10
        args.victims, args.storm, args.storm_tokens = 3, 12, 32
        args.slowloris, args.slow_bodies = 50, 50
        args.flooders, args.flood_properties, args.flood_seconds = 1, 1500, 3.0
        args.bombs = 3
        args.unread, args.unread_n, args.unread_tokens, args.disk_room = 20, 8, 100, 64 << 10
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    return args


if __name__ == "__main__":
    sys.exit(run(main, parse_args(), "faults"))
