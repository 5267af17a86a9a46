"""Pre-rendered responses on the wire: what a client reads is what aiohttp's own Response
would have sent (status line, headers, keep-alive, pipelining), over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer, make_mocked_request

from cacheproxy.edge.aiohttp_adapter import (
    PIECE,
    Rendered,
    header_lines,
    missing_private_attributes,
)
from tests.conftest import free_port

BODY = b'{"answer":"The fox eats bones. 100% sure."}'
HEADERS = {"X-Cache": "HIT", "Cache-Control": "max-age=60", "Content-Type": "application/json"}

Fetch = Callable[[bytes], Awaitable[tuple[list[bytes], bool]]]


async def _aiohttp_response(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.Response(body=BODY, headers=HEADERS)
    response.headers["X-Request-Id"] = "req-1"  # as the edge adds it, after the handler
    response.headers["X-Later"] = "yes"
    return response


async def _rendered_response(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = Rendered(header_lines(HEADERS.items()), BODY)
    response.request_id = "req-1"  # what the edge sets on a Rendered
    response.headers["X-Later"] = "yes"  # any other header added after construction
    return response


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[dict[str, int]]:
    """Two real servers answering the same response: aiohttp's Response and Rendered."""
    started = []
    for handler in (_aiohttp_response, _rendered_response):
        app = web.Application()
        app.router.add_post("/", handler)
        app.router.add_route("HEAD", "/", handler)
        server = TestServer(app, host="127.0.0.1", port=free_port())
        await server.start_server()
        started.append(server)
    yield {"aiohttp": started[0].port, "rendered": started[1].port}
    for server in started:
        await server.close()


async def _exchange(port: int, request: bytes, responses: int = 1) -> tuple[list[bytes], bool]:
    """Send raw bytes; read `responses` responses, then whether the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        out = []
        for _ in range(responses):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            out.append(head + await asyncio.wait_for(reader.readexactly(length), 5))
        try:
            closed = await asyncio.wait_for(reader.read(1), 0.3) == b""
        except TimeoutError:
            closed = False
        return out, closed
    finally:
        writer.close()


def _parsed(raw: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    assert len(headers) == len(lines), "a header appears twice"
    headers.pop(b"Date")  # the second may differ; checked for shape below
    return status, {k.lower(): v for k, v in headers.items()}, body


def _post(version: str, *extra: str) -> bytes:
    lines = [f"POST / HTTP/{version}", "Host: x", f"Content-Length: {len(b'{}')}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n{}").encode()


@pytest.mark.parametrize(("request_bytes", "closes"), [
    (_post("1.1"), False),
    (_post("1.1", "Connection: close"), True),
    (_post("1.0"), True),
    (_post("1.0", "Connection: keep-alive"), False),
], ids=["1.1", "1.1-close", "1.0", "1.0-keep-alive"])
async def test_the_wire_bytes_are_aiohttps(servers: dict[str, int], request_bytes: bytes,
                                           closes: bool) -> None:
    (expected,), expected_closed = await _exchange(servers["aiohttp"], request_bytes)
    (got,), got_closed = await _exchange(servers["rendered"], request_bytes)
    assert _parsed(got) == _parsed(expected)
    assert (got_closed, expected_closed) == (closes, closes)
    date = next(line for line in got.split(b"\r\n") if line.startswith(b"Date: "))
    assert date.endswith(b" GMT") and len(date) == len(b"Date: Mon, 30 Nov 2026 03:52:51 GMT")


async def test_pipelined_requests_get_their_responses_in_order(servers: dict[str, int]) -> None:
    responses, closed = await _exchange(servers["rendered"], _post("1.1") * 3, responses=3)
    assert [_parsed(r)[2] for r in responses] == [BODY] * 3
    assert not closed


async def test_an_answer_to_head_has_the_headers_and_no_body(servers: dict[str, int]) -> None:
    request = b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n"
    heads = {}
    for name, port in servers.items():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        heads[name] = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.3)  # nothing after the head
        writer.close()
    assert _parsed(heads["rendered"]) == _parsed(heads["aiohttp"])
    assert b"Content-Length: %d" % len(BODY) in heads["rendered"]


def test_statuses_without_a_body_are_refused() -> None:
    for status in (101, 204, 304):
        with pytest.raises(ValueError, match="carries no body"):
            Rendered(b"", b"", status=status)


async def test_on_response_prepare_signals_run_and_nothing_is_written_after() -> None:
    """A signal's header is sent; write() after prepare() is refused, as after write_eof()."""
    async def add_header(_: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-From-Signal"] = "yes"

    async def handler(request: web.Request) -> web.StreamResponse:
        response = Rendered(header_lines(HEADERS.items()), BODY)
        await response.prepare(request)
        with pytest.raises(RuntimeError):
            await response.write(b"JUNK")
        return response

    app = web.Application()
    app.on_response_prepare.append(add_header)
    app.router.add_post("/", handler)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        (raw,), closed = await _exchange(server.port, _post("1.1"))
    finally:
        await server.close()
    status, headers, body = _parsed(raw)
    assert (status, headers[b"x-from-signal"], body, closed) == (b"HTTP/1.1 200 OK", b"yes",
                                                                  BODY, False)


async def test_cookies_compression_and_chunks_are_refused() -> None:
    for setup in ("cookie", "compression", "chunks"):
        response = Rendered(b"", BODY)
        if setup == "cookie":
            response.set_cookie("a", "1")
        elif setup == "compression":
            response.enable_compression()
        else:
            response.enable_chunked_encoding()
        with pytest.raises(RuntimeError, match="cookies, compression or chunks"):
            await response.prepare(make_mocked_request("POST", "/"))


def test_header_lines_refuse_control_characters() -> None:
    assert header_lines([("A", "1"), ("B", "two")]) == b"A: 1\r\nB: two\r\n"
    for bad in [("A", "1\r\nInjected: yes"), ("A", "1\nB: 2"), ("A\r", "1"), ("A", "\x00"),
                ("A", "\x7f")]:
        with pytest.raises(ValueError, match="CR or LF"):
            header_lines([bad])


async def test_a_header_or_request_id_added_later_is_checked_too() -> None:
    for late in ("header", "request_id"):
        response = Rendered(b"", BODY)
        if late == "header":
            response.headers["X-Later"] = "a\nb"
        else:
            response.request_id = "a\rb"
        with pytest.raises(ValueError, match="CR or LF"):
            await response.prepare(make_mocked_request("POST", "/"))


async def test_write_eof_before_prepare_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="not been prepared"):
        await Rendered(b"", BODY).write_eof()


def test_the_private_aiohttp_attributes_it_relies_on_exist() -> None:
    missing = missing_private_attributes(make_mocked_request("GET", "/"))
    assert not missing, (
        f"aiohttp {aiohttp.__version__} no longer has {', '.join(missing)}: "
        "cacheproxy.edge.aiohttp_adapter.py must follow what StreamResponse does now")


async def test_a_large_body_goes_in_pieces_and_reads_as_aiohttps() -> None:
    """A body over PIECE bytes, given as pieces (as a large HIT's template parts are), is
    sent piece by piece: a client reads the very bytes aiohttp's Response sends, and the
    next pipelined response after it."""
    parts = [b"x" * (PIECE + 17), b"-mark-", b"y" * 5, b"z" * (3 * PIECE)]

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.path == "/aiohttp":
            return web.Response(body=b"".join(parts), headers=HEADERS)
        return Rendered(header_lines(HEADERS.items()), parts)

    app = web.Application()
    app.router.add_post("/{kind}", handler)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        got = {}
        for kind in ("aiohttp", "rendered"):
            request = _post("1.1").replace(b"POST / ", f"POST /{kind} ".encode())
            got[kind], closed = await _exchange(server.port, request * 2, responses=2)
            assert not closed
    finally:
        await server.close()
    assert [_parsed(r) for r in got["rendered"]] == [_parsed(r) for r in got["aiohttp"]]
    assert _parsed(got["rendered"][1])[2] == b"".join(parts)
