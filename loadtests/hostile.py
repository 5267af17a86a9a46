"""Malformed and hostile HTTP requests for faults.py, generated with hypothesis, sent raw.

Every request goes over its own TCP socket (`Connection: close`), written byte for byte, so
bodies can be anything: wrong JSON types, huge numbers, NaN, deep nesting, invalid UTF-8,
oversized bodies, truncated JSON, unknown fields, odd paths, methods and content types.
Truncated chunked bodies and short Content-Lengths are sent separately (the client hangs up
its writing side after a partial body). A response is counted by its status; no response at
all counts as `dropped`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

HOST = "127.0.0.1"
PATHS = ["/v1/chat/completions", "/v1/completions"]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stream", "stream_options", "stop", "n",
          "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "user", "tools", "response_format", "echo", "suffix"]
VALID = {"model": "demo", "messages": [{"role": "user", "content": "What does the fox eat?"}],
         "max_tokens": 4}

huge_ints = st.one_of(st.integers(), st.integers(min_value=2**63 - 2, max_value=10**400),
                      st.integers(min_value=-(10**400), max_value=-(2**63) + 2))
scalars = st.one_of(st.none(), st.booleans(), huge_ints,
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20)


def dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _deep(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


bodies = st.one_of(
    # a valid request with one field replaced (wrong type, huge number, NaN, nesting...)
    st.tuples(st.just("mutated"), st.sampled_from(FIELDS), json_values).map(
        lambda t: (t[0], dumps(VALID | {t[1]: t[2]}))),
    # random objects over the known field names and unknown ones
    st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=12)), json_values,
                    max_size=8).map(lambda d: ("fields", dumps(d))),
    # messages of the wrong shapes
    st.lists(json_values, max_size=4).map(
        lambda m: ("messages", dumps(VALID | {"messages": m}))),
    st.tuples(st.integers(1, 200_000), st.sampled_from(["list", "dict"])).map(
        lambda t: ("deep", dumps(VALID | {"stop": "x"})[:-1] + b',"x":' + _deep(*t) + b"}")),
    st.binary(max_size=300).map(lambda b: ("bytes", b)),
    st.tuples(st.binary(min_size=1, max_size=8), st.integers(0, 60)).map(  # invalid UTF-8
        lambda t: ("utf8", dumps(VALID)[:t[1]] + b"\xff\xfe\xc3" + t[0] + dumps(VALID)[t[1]:])),
    st.integers(0, len(dumps(VALID)) - 1).map(lambda k: ("truncated-json", dumps(VALID)[:k])),
    st.integers(65_537, 2_000_000).map(
        lambda n: ("oversized", dumps(VALID | {"user": "u" * n}))),
    st.tuples(st.sampled_from(["top_logprobs", "n", "max_tokens", "seed", "top_k"]),
              huge_ints).map(lambda t: ("numbers", dumps(VALID | {t[0]: t[1]}))),
)
requests = st.tuples(
    bodies,
    st.sampled_from(PATHS + ["/v1/models", "/health", "/v1/chat/completions/x", "/%ff", "/"]),
    st.sampled_from(["POST"] * 8 + ["GET", "PUT", "DELETE"]),
    st.sampled_from(["application/json"] * 6
                    + ["text/plain", "", "application/json; charset=latin-1"]),
)


@dataclass
class Counts:
    """Responses by status, requests by kind, and the first few 5xx for the report."""

    statuses: Counter[int] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    dropped_kinds: Counter[str] = field(default_factory=Counter)

    @property
    def dropped(self) -> int:
        return sum(self.dropped_kinds.values())

    @property
    def total(self) -> int:
        return sum(self.statuses.values()) + self.dropped

    @property
    def server_errors(self) -> int:
        return sum(v for k, v in self.statuses.items() if k >= 500)

    def add(self, kind: str, status: int | None, head: bytes) -> None:
        self.kinds[kind] += 1
        if status is None:
            self.dropped_kinds[kind] += 1
            return
        self.statuses[status] += 1
        if status >= 500 and len(self.examples) < 20:
            self.examples.append(f"{kind}: {head[:200]!r}")


def exchange(port: int, head: bytes, body: bytes, *, half_close: bool = False,
             timeout: float = 30.0) -> int | None:
    """Send bytes, read the answer to the end; the status, or None when there was none."""
    data = b""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        with contextlib.suppress(OSError):
            s.sendall(head + body)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                data += chunk
                if len(data) > 1 << 20:
                    break
    try:
        return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else None
    except (IndexError, ValueError):
        return None


def request_head(method: str, path: str, ctype: str, length: int | None,
                 chunked: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", "Connection: close"]
    if ctype:
        lines.append(f"Content-Type: {ctype}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_of(port: int, method: str, path: str, body: bytes) -> int | None:
    return exchange(port, request_head(method, path, "application/json", len(body)), body)


def raw_cases(port: int, counts: Counts, n: int) -> None:
    """Truncated chunked bodies and short Content-Lengths: the client stops writing early."""
    full = dumps(VALID)
    for i in range(n):
        cut = 1 + i % (len(full) - 1)
        head = request_head("POST", PATHS[i % 2], "application/json", None, chunked=True)
        part = f"{len(full):x}\r\n".encode() + full[:cut]  # a chunk cut short, no terminator
        counts.add("truncated-chunked", exchange(port, head, part, half_close=True), head)
        head = request_head("POST", PATHS[i % 2], "application/json", len(full) + 10)
        counts.add("short-content-length", exchange(port, head, full[:cut], half_close=True),
                   head)
        bad = full.replace(b"fox", b"f\xc3\x28x")  # invalid UTF-8 inside a JSON string
        head = request_head("POST", PATHS[0], "application/json", len(bad))
        counts.add("utf8-raw", exchange(port, head, bad), head)


def run_all(port: int, n: int, *, deadline: float) -> Counts:
    """n hypothesis-generated requests plus raw truncated/invalid-UTF-8 cases (n / 30 each)."""
    counts = Counts()

    @settings(max_examples=n, database=None, deadline=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(requests)
    def send(req: tuple[tuple[str, bytes], str, str, str]) -> None:
        (kind, body), path, method, ctype = req
        if time.monotonic() > deadline:
            return
        head = request_head(method, path, ctype, len(body))
        counts.add(kind, exchange(port, head, body), head + body[:120])

    send()
    raw_cases(port, counts, max(5, n // 30))
    return counts
