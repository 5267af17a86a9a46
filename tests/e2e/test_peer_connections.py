"""The bound on connections from one client address (#34, `--max-connections-per-peer`):
a client opening connections in a loop takes the places of its own, never of others; one
whose every connection is busy gets the 503 for one more. Real sockets from two loopback
addresses (127.0.0.2 is loopback too on Linux), on the in-process server with the guard
installed as `serve` installs it."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import time

import pytest

from cacheproxy.edge.aiohttp_adapter import ConnectionGuard
from cacheproxy.edge.state import BODIES
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from tests.conftest import Proxy, ProxyFactory, eventually

OTHER = "127.0.0.2"  # the client in a loop; the others connect from 127.0.0.1


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _guarded(make_proxy: ProxyFactory, *, per_peer: int | None
                   ) -> tuple[Proxy, ConnectionGuard]:
    proxy = await make_proxy()
    assert proxy.server is not None and proxy.server.runner is not None
    server = proxy.server.runner.server
    assert server is not None
    guard = ConnectionGuard(server, 20, max_per_peer=per_peer, bodies=proxy.app[BODIES])
    guard.install()
    return proxy, guard


def _health(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    return response.status


def _open(sock: socket.socket) -> bool:
    """Whether the server still holds this connection open (no EOF, no reset)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(1) != b""
    except TimeoutError:
        return True
    except OSError:
        return False


def _loop_then_ask(port: int) -> tuple[int, int]:
    """An established keep-alive client; then another address opens 30 connections, each
    making one request and staying open (idle keep-alive, as the client is): (the
    client's next status, 0 if its connection was taken; the loop's connections left open)."""
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    assert _health(client) == 200
    loop = []
    try:
        for _ in range(30):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10,
                                              source_address=(OTHER, 0))
            with contextlib.suppress(ConnectionError, http.client.HTTPException):
                _health(conn)
            loop.append(conn)
        time.sleep(0.3)  # (evicted connections are closed on the server's next turn)
        try:
            again = _health(client)
        except (ConnectionError, http.client.HTTPException):
            again = 0
        left = sum(_open(conn.sock) for conn in loop if conn.sock is not None)
        return again, left
    finally:
        client.close()
        for conn in loop:
            conn.close()


async def test_a_client_in_a_loop_takes_the_places_of_its_own(
        make_proxy: ProxyFactory) -> None:
    proxy, guard = await _guarded(make_proxy, per_peer=5)
    again, left = await asyncio.to_thread(_loop_then_ask, _port(proxy.url))
    assert again == 200, guard.counters
    assert left == 5, (left, guard.counters)  # its oldest closed as it opened more
    assert guard.counters["peer_bound_hits"] == 25, guard.counters


async def test_control_without_the_peer_bound_the_loop_takes_the_others_place(
        make_proxy: ProxyFactory) -> None:
    # Control: only --max-connections (20): past it the oldest idle keep-alive connection
    # gives way, and the established client's is the oldest.
    proxy, guard = await _guarded(make_proxy, per_peer=None)
    again, left = await asyncio.to_thread(_loop_then_ask, _port(proxy.url))
    assert again == 0, guard.counters
    assert left == 20, (left, guard.counters)  # (and it took its own places after)
    assert guard.counters["peer_bound_hits"] == 0


def _busy_then_one_more(port: int) -> tuple[bytes, int]:
    """Two connections from OTHER, each inside a long generation (the second queued behind
    the first): (what a third from OTHER is answered, what one from 127.0.0.1 is)."""
    eos = json.loads((BUNDLED_MODEL / "config.json").read_text())["eos_token_id"]
    long = json.dumps({"prompt": "Once upon a time", "max_tokens": 200,
                       "logit_bias": {str(t): -100 for t in eos}}).encode()
    held = [socket.create_connection(("127.0.0.1", port), source_address=(OTHER, 0))
            for _ in range(2)]
    try:
        for sock in held:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%b"
                         % (len(long), long))
        time.sleep(0.3)  # (both are being answered)
        with socket.create_connection(("127.0.0.1", port), timeout=1,
                                      source_address=(OTHER, 0)) as third:
            try:
                answer = third.recv(4096)
            except TimeoutError:  # admitted: it is waiting for a request
                answer = b""
        other = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            status = _health(other)
        finally:
            other.close()
        return answer, status
    finally:
        for sock in held:
            sock.close()


@pytest.mark.parametrize("per_peer", [2, None])
async def test_a_client_whose_connections_are_all_busy_gets_503_for_one_more(
        make_proxy: ProxyFactory, per_peer: int | None) -> None:
    proxy, guard = await _guarded(make_proxy, per_peer=per_peer)
    answer, status = await asyncio.to_thread(_busy_then_one_more, _port(proxy.url))
    assert status == 200  # another address is served either way
    if per_peer is None:  # control: 3 of 20 places, the third connection is admitted
        assert answer == b"", answer
        assert guard.counters["connections_refused"] == 0
    else:
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b'"code":"overloaded"' in answer and b"Retry-After: 1" in answer
        assert guard.counters["connections_refused"] == 1, guard.counters
    # (the generations end by themselves: the lane is free for the next test)
    assert proxy.server is not None and proxy.server.runner is not None
    server = proxy.server.runner.server
    assert server is not None
    await eventually(lambda: not server.connections, within=60)
