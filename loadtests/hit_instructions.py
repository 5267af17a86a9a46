"""Benchmark: CPU instructions per repeated HIT, counted by callgrind, this tree against another.

    python loadtests/hit_instructions.py --vs /path/to/other/checkout [--stream] [--seeds 0,1]
    python loadtests/hit_instructions.py --bare [--seeds 0,1]   # this tree vs the bare responder

Wall-clock hit throughput on a shared VM moves by ±10 % between identical runs; the count of
instructions the server executes per request does not (for one hash seed: PYTHONHASHSEED
changes dict layouts, so each seed is a run of its own, and the table gives each). For each
seed and tree in turn it starts `python -m cacheproxy serve --store memory://` (that tree on
PYTHONPATH) under `valgrind --tool=callgrind --instr-atstart=no`, primes a HIT, sends 200
warm-up repeats, switches counting on (`callgrind_control -i on`), sends N repeats on one
keep-alive connection, switches it off and dumps. Needs valgrind (Debian's package).

With --bare the baseline is `bench_hit.py`'s bare aiohttp + uvloop responder answering the very
bytes of this tree's HIT: the ratio bare / this tree is the instruction count's side of
bench_hit's throughput ratio (user-space instructions only: the kernel's share of a request,
the same socket read and write for both, is not counted, so this ratio is the lower of the two).
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "cacheproxy-demo", "max_tokens": 32,
        "messages": [{"role": "user", "content": "What does the fox eat?"}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(conn: http.client.HTTPConnection, body: bytes) -> str:
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.getheader("X-Cache") or ""


def hit_body(stream: bool) -> bytes:
    """The bytes of a HIT of BODY, from an in-process proxy of this tree (no valgrind)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "cacheproxy", "serve", "--port", str(port), "--store",
           "memory://", "--no-watch"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    try:
        _wait(port, proc, limit=120)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = json.dumps({**BODY, "stream": stream}).encode()
        _post(conn, body)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        return conn.getresponse().read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _wait(port: int, proc: subprocess.Popen[bytes], limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("GET", "/health")
            conn.getresponse().read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def count(tree: Path, seed: int, requests: int, stream: bool, work: Path,
          bare_body: Path | None = None, extra: tuple[str, ...] = ()) -> int:
    """Instructions per repeated HIT of the server in `tree` (or, given `bare_body`, of the
    bare responder answering those bytes)."""
    port, out = _free_port(), work / f"cg-{tree.name}-{seed}-{stream}-{bare_body is None}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": str(seed),
           "PYTHONPATH": str(tree)}
    server = ["-m", "cacheproxy", "serve", "--port", str(port), "--store", "memory://",
              "--no-watch", "--max-connections", "100", *extra]
    if bare_body is not None:
        server = [str(ROOT / "loadtests" / "bench_hit.py"), "--_bare", str(port),
                  str(bare_body), *(["--stream"] if stream else [])]
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
           f"--callgrind-out-file={out}.%p", sys.executable, *server]
    # valgrind refuses to change the open-file hard limit, which mlx-lm sets to 4096 on import.
    with (work / "server.log").open("ab") as log:
        proc = subprocess.Popen(["bash", "-c", "ulimit -Sn 4096; exec " + shlex.join(cmd)],
                                stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        _wait(port, proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = json.dumps({**BODY, "stream": stream}).encode()
        _post(conn, body)
        if bare_body is None and not _post(conn, body).startswith("HIT"):
            raise RuntimeError("the second request was not a HIT")
        for _ in range(200):
            _post(conn, body)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True,
                       capture_output=True)
        for _ in range(requests):
            _post(conn, body)
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True,
                       capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True,
                       capture_output=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    total = 0
    for name in glob.glob(f"{out}.*"):
        with open(name, errors="replace") as dump:
            total += sum(int(line.split()[1]) for line in dump if line.startswith("totals:"))
    if not total:
        raise RuntimeError(f"callgrind counted nothing (see {work / 'server.log'})")
    return round(total / requests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    baseline = parser.add_mutually_exclusive_group(required=True)
    baseline.add_argument("--vs", type=Path, help="the other checkout (baseline)")
    baseline.add_argument("--bare", action="store_true",
                          help="baseline: bench_hit.py's bare responder with this tree's HIT")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--serve-args", default="", metavar="ARGS",
                        help="more arguments for this tree's `cacheproxy serve` (shell words)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bare_body = None
        if args.bare:
            bare_body = Path(tmp) / "hit_body"
            bare_body.write_bytes(hit_body(args.stream))
        for seed in seeds:
            base = count(ROOT if args.bare else args.vs.resolve(), seed, args.requests,
                         args.stream, Path(tmp), bare_body)
            this = count(ROOT, seed, args.requests, args.stream, Path(tmp),
                         extra=tuple(shlex.split(args.serve_args)))
            rows.append((seed, base, this))
    mode = "stream" if args.stream else "non-stream"
    name = "bare responder" if args.bare else "baseline"
    print(f"| {mode} | seed | {name} instr/HIT | this tree instr/HIT | this / {name} "
          f"| {name} / this |")
    print("|---|---:|---:|---:|---:|---:|")
    for seed, base, this in rows:
        print(f"| {mode} | {seed} | {base} | {this} | {this / base:.3f} | {base / this:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
