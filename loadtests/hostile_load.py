"""Hostile load against a running proxy (#34), as faults.py's `schema-flood` and
`slow-bodies` scenarios run it (the suite runs the same functions in-process, small):

  schema_flood_against   clients loop on a response_format of N properties (asked
                         only-if-cached: its parse is all the work each makes) while a HIT
                         is timed: its median must stay under 50 ms
  regex_bombs_against    N distinct regex-bomb schemas (170 bytes, ~2 million regex states
                         each), one after another: each a 400 schema_too_complex, and the
                         server's RSS after them within +200 MB of before
  slow_bodies_against    N connections send a request's headers, then its body a byte every
                         3 s (each one the server closes is opened again), while fresh
                         clients (a new connection each) and keep-alive clients (connected
                         before) ask for a HIT: >= 95 % of the fresh ones must be served
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import multiprocessing
import resource
import socket
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

PATH = "/v1/chat/completions"


def hit_body(model: str) -> dict[str, Any]:
    """The request whose HIT is timed."""
    return {"model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "What does the fox eat?"}]}


def wide(properties: int, model: str, tag: str = "") -> dict[str, Any]:
    """A request whose response_format has `properties` integer properties (10,000: 340 KB)."""
    schema = {"type": "object",
              "properties": {f"field_{i}": {"type": "integer"} for i in range(properties)}}
    return {"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": f"Fill the fields. {tag}"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "wide", "schema": schema}}}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank; inf when empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("inf")


def bomb(n: int, model: str) -> dict[str, Any]:
    """A request whose response_format is a 170-byte regex bomb (each n a new grammar)."""
    return {"model": model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say a word."}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "bomb",
                "schema": {"type": "string", "pattern": f"^((a{{200}}){{100}}){{{n}}}$"}}}}


async def regex_bombs_against(url: str, rss_mb: Any, *, bombs: int = 50,
                              model: str = "demo") -> tuple[Counter[str], float, float]:
    """Send `bombs` distinct regex bombs one after another; (status:code counts, the server's
    RSS in MiB before, after), `rss_mb()` reading it."""
    codes: Counter[str] = Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(url + PATH, json=hit_body(model)) as r:  # a first grammar-less
            await r.read()  # answer: the model and its tokenizer warm, as in service
        before = rss_mb()
        for n in range(100, 100 + bombs):
            async with session.post(url + PATH, json=bomb(n, model)) as r:
                answer = await r.json(content_type=None)
                code = (answer.get("error") or {}).get("code") if isinstance(answer, dict) else None
                codes[f"{r.status}:{code}"] += 1
    return codes, before, rss_mb()


@dataclass
class Flood:
    """What the schema flood measured."""

    hit_ms: list[float] = field(default_factory=list)
    flood_statuses: Counter[int] = field(default_factory=Counter)

    @property
    def median_ms(self) -> float:
        """Median HIT time (inf when none was timed)."""
        return statistics.median(self.hit_ms) if self.hit_ms else float("inf")


async def schema_flood_against(url: str, *, properties: int = 10_000, flooders: int = 2,
                               seconds: float = 10.0, model: str = "demo") -> Flood:
    """`flooders` clients send the wide schema back to back for `seconds` while one client
    times a HIT every 20 ms; the flood's answers are counted by status (504 not_cached:
    parsed; 400: refused by the budget; 503: the parse queue full)."""
    out = Flood()
    timeout = aiohttp.ClientTimeout(total=seconds + 300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + PATH, json=hit_body(model)) as resp:
            await resp.read()  # stored: every later one is a HIT
        stop_at = time.monotonic() + seconds

        async def flood(n: int) -> None:
            sent = 0
            while time.monotonic() < stop_at:
                sent += 1
                async with session.post(url + PATH, json=wide(properties, model, f"{n}.{sent}"),
                                        headers={"Cache-Control": "only-if-cached"}) as resp:
                    await resp.read()
                    out.flood_statuses[resp.status] += 1

        async def timer() -> None:
            await asyncio.sleep(min(1.0, seconds / 4))  # (the first parses begun)
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                async with session.post(url + PATH, json=hit_body(model)) as resp:
                    await resp.read()
                    if resp.headers.get("X-Cache") == "HIT":
                        out.hit_ms.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(0.02)

        await asyncio.gather(timer(), *(flood(n) for n in range(flooders)))
    return out


@dataclass
class SlowBodies:
    """What the slow-body attack measured."""

    fresh_ms: list[float] = field(default_factory=list)  # of the fresh clients served
    fresh_sent: int = 0
    keep_alive_served: int = 0
    keep_alive_sent: int = 0
    reopened: int = 0  # slow connections the server closed (and the attacker reopened)
    fresh_statuses: Counter[int] = field(default_factory=Counter)
    keep_alive_statuses: Counter[int] = field(default_factory=Counter)
    connections: dict[str, int] = field(default_factory=dict)  # /health's, at the end

    @property
    def fresh_share(self) -> float:
        """Share of the fresh clients answered 200."""
        return len(self.fresh_ms) / self.fresh_sent if self.fresh_sent else 0.0


def _slow(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 100000\r\n\r\n{")
    sock.setblocking(False)
    return sock


def _ask(client: http.client.HTTPConnection, body: str) -> int:
    """POST the HIT on `client`: the status, 0 when the connection failed."""
    try:
        client.request("POST", PATH, body, {"Content-Type": "application/json"})
        response = client.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return 0


def _attack(port: int, n: int, every: float, stop: Any, reopened: Any, ready: Any,
            reopen: bool) -> None:
    """`n` slow-body connections kept open until `stop` is set: a byte every `every` s on
    each; each one the server closed (a 408, or closed) opened again when `reopen`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, n + 256), hard), hard))
    socks = [_slow(port) for _ in range(n)]
    ready.set()
    next_byte = time.monotonic() + every
    while not stop.wait(0.25):
        send = time.monotonic() >= next_byte
        next_byte += every if send else 0.0
        for i, sock in enumerate(socks):
            if sock is _DONE:
                continue
            try:
                if sock.recv(4096) == b"":
                    raise ConnectionResetError
            except BlockingIOError:  # nothing from the server: still held
                with contextlib.suppress(OSError):
                    if send:
                        sock.send(b" ")
                continue
            except OSError:
                pass
            sock.close()
            if not reopen:
                socks[i] = _DONE
                continue
            with contextlib.suppress(OSError):
                socks[i] = _slow(port)
                reopened.value += 1
    for sock in socks:
        sock.close()


_DONE = socket.socket()  # (a closed connection the attacker gave up: never used)
_DONE.close()


class _Attack:
    """`_attack` in a process of its own (so the clients it is measured against are not
    slowed by its work in their own interpreter)."""

    def __init__(self, port: int, n: int, *, reopen: bool, every: float = 3.0) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._reopened = context.Value("q", 0)
        ready = context.Event()
        self._process = context.Process(target=_attack, args=(
            port, n, every, self._stop, self._reopened, ready, reopen))
        self._process.start()
        if not ready.wait(120):
            self.stop()
            raise RuntimeError("the attacker did not open its connections within 120 s")

    @property
    def reopened(self) -> int:
        """Connections the server closed and the attacker opened again."""
        return int(self._reopened.value)

    def stop(self) -> None:
        """Stop the attacker (its connections closed)."""
        self._stop.set()
        self._process.join(30)


def slow_bodies_against(url: str, *, slow: int = 1000, fresh: int = 100, keep_alive: int = 10,
                        reopen: bool = False, model: str = "demo") -> SlowBodies:
    """The slow-body attack against the proxy at `url` (blocking: raw sockets; the attacker
    in a process of its own), with `fresh` clients on new connections and `keep_alive`
    clients connected before it; `reopen`: the attacker opens again every connection the
    server closes (a connection flood of its own once the rate floor cuts them)."""
    port, body, out = int(url.rsplit(":", 1)[1]), json.dumps(hit_body(model)), SlowBodies()
    held = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(keep_alive)]
    if not all(_ask(client, body) == 200 for client in held):  # the HIT stored; connected
        raise RuntimeError("the proxy did not answer the keep-alive clients before the attack")
    attack = _Attack(port, slow, reopen=reopen)
    stop = threading.Event()

    def keep_asking(client: http.client.HTTPConnection) -> None:
        while True:  # at once, then every 5 s (a client with work, within --idle-timeout)
            out.keep_alive_statuses[_ask(client, body)] += 1
            if stop.wait(5.0):
                return

    askers = [threading.Thread(target=keep_asking, args=(c,), daemon=True) for c in held]
    try:
        time.sleep(1.0)  # (every slow connection in its body)
        for asker in askers:
            asker.start()
        for _ in range(fresh):
            client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            started = time.perf_counter()
            status = _ask(client, body)
            out.fresh_statuses[status] += 1
            if status == 200:
                out.fresh_ms.append((time.perf_counter() - started) * 1000)
            client.close()
        out.fresh_sent = fresh
        health = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        health.request("GET", "/health")
        out.connections = json.loads(health.getresponse().read()).get("connections", {})
        health.close()
    finally:
        stop.set()
        for asker in askers:
            asker.join(60)
        attack.stop()
        out.reopened = attack.reopened
        for client in held:
            client.close()
    out.keep_alive_sent = sum(out.keep_alive_statuses.values())
    out.keep_alive_served = out.keep_alive_statuses[200]
    return out
