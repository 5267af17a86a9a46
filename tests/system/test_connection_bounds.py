"""Time bounds per connection (#19): a client that trickles its headers, trickles its body,
or stops reading costs one connection for a bounded time, never the server. Real
`cacheproxy serve` processes (the bounds live in its aiohttp server), real sockets."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.request
from pathlib import Path

from tests.e2e.test_proxy import NO_EOS
from tests.harness.processes import serving

PARTIAL_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _health(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _closed_within(sock: socket.socket, seconds: float, trickle: bool) -> float | None:
    """Seconds until the server closed `sock` (trickling a header byte every 0.2 s when
    asked), or None if it stayed open."""
    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < seconds:
        try:
            if trickle:
                sock.sendall(b"a")
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
    return None


def test_headers_that_never_end_and_idle_keep_alive_are_closed_after_the_idle_timeout(
) -> None:
    with serving("--store", "memory://", "--no-watch", "--idle-timeout", "1") as url:
        with socket.create_connection(("127.0.0.1", _port(url))) as slow:
            slow.sendall(PARTIAL_HEAD)  # then a byte every 0.2 s: progress, never an end
            closed = _closed_within(slow, 5, trickle=True)
        assert closed is not None and 0.8 <= closed <= 3, closed
        with socket.create_connection(("127.0.0.1", _port(url))) as idle:
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert idle.recv(4096).startswith(b"HTTP/1.1 200")
            closed = _closed_within(idle, 5, trickle=False)  # kept alive, then idle
        assert closed is not None and closed <= 3, closed


def test_clients_that_never_finish_their_headers_cannot_lock_the_others_out() -> None:
    with serving("--store", "memory://", "--no-watch", "--max-connections", "20") as url:
        held = [socket.create_connection(("127.0.0.1", _port(url))) for _ in range(20)]
        clients: list[http.client.HTTPConnection] = []
        try:
            for sock in held:
                sock.sendall(PARTIAL_HEAD)
            time.sleep(0.3)
            body = json.dumps({"prompt": "The fox", "max_tokens": 4})
            # Ten clients that stay connected (keep-alive): each new one takes the place
            # of the oldest connection waiting for its headers, a trickler.
            for _ in range(10):
                client = http.client.HTTPConnection("127.0.0.1", _port(url), timeout=30)
                clients.append(client)
                client.request("POST", "/v1/completions", body,
                               {"Content-Type": "application/json"})
                response = client.getresponse()
                assert response.status == 200, response.read()
                response.read()
            for client in clients:  # and every one of them is still served
                client.request("GET", "/health")
                response = client.getresponse()
                connections = json.loads(response.read())["connections"]
                assert response.status == 200
            assert connections["connections_evicted"] == 10
            assert connections["connections_refused"] == 0
        finally:
            for client in clients:
                client.close()
            for sock in held:
                sock.close()


def test_an_answer_left_unread_is_cut_after_the_send_timeout(tmp_path: Path) -> None:
    # A large answer (16 choices x 400 tokens x 20 alternatives: several MB), stored once.
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me about the fox."}],
                       "n": 16, "max_tokens": 400, "logprobs": True, "top_logprobs": 20,
                       "logit_bias": NO_EOS}).encode()
    with serving("--store", "memory://", "--no-watch", "--send-timeout", "1") as url:
        request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert len(resp.read()) > 4 << 20
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(("127.0.0.1", _port(url)))
        try:
            reader.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                           % (len(body), body))  # the HIT is sent; this client never reads
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                connections = _health(url)["connections"]
                assert isinstance(connections, dict)
                if connections["send_timeouts"]:
                    break
                time.sleep(0.5)
            assert connections["send_timeouts"] == 1
            assert _health(url)["status"] == "ok"  # and the server goes on
        finally:
            reader.close()
