"""Time bounds per connection (#19) that need no `serve` process: a body that does not
arrive in time is a 408, and the kernel send buffer each accepted connection inherits.
(Idle, header and send timeouts live in `serve`'s aiohttp server:
tests/system/test_connection_bounds.py.)"""

from __future__ import annotations

import json
import socket
import time

from tests.conftest import ProxyFactory
from tests.e2e.test_bad_input import _raw_post


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_a_body_that_does_not_arrive_in_time_is_a_408(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(body_timeout=0.5)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    started = time.monotonic()
    status, answer = await _raw_post(_port(proxy.url), head, [b'{"messages": '])
    assert status == 408 and json.loads(answer)["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 5
    assert await proxy.entries() == 0


def test_send_buffer_bounds_what_the_kernel_holds_for_each_accepted_connection() -> None:
    """`--send-buffer`: every connection the server accepts inherits the listening socket's
    SO_SNDBUF (Linux doubles the value asked, for its bookkeeping); 0 leaves the kernel's
    autotuned buffer, which grows to megabytes for a client that does not read."""

    from cacheproxy.cli.serve import listening_socket

    for asked in (16384, 0):
        listener = listening_socket("127.0.0.1", 0, send_buffer=asked)
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        size = accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert size == 2 * asked if asked else size > 2 * 16384, (asked, size)
        for s in (accepted, client, listener):
            s.close()
