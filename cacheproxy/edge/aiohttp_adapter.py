"""The one module that leans on aiohttp's internals: pre-rendered responses, the
connection limit, and the body limit applied to `Expect: 100-continue`.

Pre-rendered responses: head and body rendered to bytes in advance, written in one call.

aiohttp's StreamResponse builds a CIMultiDict, checks and serializes every header and
writes head and body through its stream writer on every response; measured on a cache
HIT (wrk, c=16) that cost 14 µs of the 48 a request took. A repeated HIT knows its
status, headers and body up front except for a few values (request id, Age, Date), so
`Rendered` takes the header block as bytes and only renders those few per request.

It follows what StreamResponse does for the same response: the request's HTTP version on
the status line, the Connection header and keep-alive decision, Content-Length, Date and
Server, headers set after construction (the edge's X-Request-Id), control characters in
a header refused, no body in an answer to HEAD. Only for statuses that carry a body (not
1xx, 204 or 304).

The connection limit: aiohttp's Server has no hook to refuse a connection, so
`limit_connections` wraps `Server.connection_made`, which its RequestHandler calls for every
new connection.

What this relies on is listed in `PRIVATE_ATTRIBUTES` (and `Server.connection_made`);
`missing_private_attributes()` says which of them an installed aiohttp lacks, and a test
fails with that list when an upgrade changes them.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from functools import lru_cache

import orjson
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import SERVER_SOFTWARE, HttpVersion, HttpVersion10, HttpVersion11
from aiohttp.web_protocol import RequestHandler

from cacheproxy.errors import Overloaded

_SERVER = f"Server: {SERVER_SOFTWARE}\r\n".encode()
PRIVATE_ATTRIBUTES = {
    "StreamResponse": ("_eof_sent", "_cookies", "_compression", "_chunked", "_keep_alive",
                       "_status", "_reason", "_headers", "_body_length"),
    "BaseRequest": ("_prepare_hook",),
    "Server": ("connection_made", "connections"),
}


def missing_private_attributes(request: web.BaseRequest) -> list[str]:
    """The aiohttp internals this module relies on that this aiohttp lacks (given any
    request, such as aiohttp.test_utils.make_mocked_request's)."""
    objects = {"StreamResponse": web.StreamResponse(), "BaseRequest": request,
               "Server": web.Server}
    return [f"{kind}.{name}" for kind, names in PRIVATE_ATTRIBUTES.items()
            for name in names if not hasattr(objects[kind], name)]


class HttpDate:
    """The Date header value (RFC 9110 IMF-fixdate), formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def now(self) -> bytes:
        """`Date: …\\r\\n` for the current second."""
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._value = f"Date: {formatdate(second, usegmt=True)}\r\n".encode()
        return self._value


_date = HttpDate()


# What aiohttp refuses in a header name or value (CR and LF would inject headers).
_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """`Name: value\\r\\n` lines; ValueError on a control character (CR, LF, NUL...)."""
    text = ""
    for name, value in headers:
        if _FORBIDDEN.search(name) or _FORBIDDEN.search(value):
            raise ValueError(f"header {name!r} holds a control character such as CR or LF")
        text += f"{name}: {value}\r\n"
    return text.encode()


@lru_cache(maxsize=64)
def _status_line(version: HttpVersion, status: int, reason: str) -> bytes:
    return f"HTTP/{version.major}.{version.minor} {status} {reason}\r\n".encode()


def _connection(version: HttpVersion, keep_alive: bool) -> bytes:
    """The Connection header where the version's default is not what happens (as aiohttp)."""
    if keep_alive:
        return b"Connection: keep-alive\r\n" if version == HttpVersion10 else b""
    return b"Connection: close\r\n" if version == HttpVersion11 else b""


class Rendered(web.StreamResponse):
    """A response from a pre-rendered header block and body.

    `head` holds `Name: value\\r\\n` lines (from `header_lines`) without Content-Length,
    Date, Server and Connection, which are added when it is sent (so `headers` must not
    hold them either). `request_id`, when set, is sent as X-Request-Id (the edge sets it;
    cheaper than a header added to `headers`). prepare() sends everything and ends the
    response: no cookies, compression, chunking or later writes.
    """

    request_id = ""

    def __init__(self, head: bytes, body: bytes, *, status: int = 200) -> None:
        if status < 200 or status in (204, 304):
            raise ValueError(f"a {status} response carries no body: not a Rendered one")
        super().__init__(status=status)
        self._head = head
        self._rendered = body

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        """Write the whole response, head and body, in one call, and end it."""
        if self._eof_sent:
            return None
        if self._cookies or self._compression or self._chunked:
            raise RuntimeError("a rendered response sends no cookies, compression or chunks")
        await request._prepare_hook(self)  # on_response_prepare signals, as aiohttp runs them
        version = request.version
        keep_alive = request.keep_alive if self._keep_alive is None else self._keep_alive
        self._keep_alive = keep_alive
        body = self._rendered
        request_id = self.request_id
        if not request_id.isprintable():  # stricter than _FORBIDDEN, and a tenth of its cost
            raise ValueError("the request id holds a control character such as CR or LF")
        data = b"".join((
            _status_line(version, self._status, self._reason), self._head,
            b"X-Request-Id: %s\r\n" % request_id.encode() if request_id else b"",
            header_lines(self._headers.items()) if self._headers else b"",
            _connection(version, keep_alive), b"Content-Length: %d\r\n" % len(body),
            _date.now(), _SERVER, b"\r\n", b"" if request.method == "HEAD" else body))
        writer = request.writer
        await writer.write_eof(data)  # writes, then drains as StreamResponse does
        self._eof_sent = True  # so write() after this is refused, as after write_eof()
        self._body_length = len(body)
        return writer

    async def write_eof(self, data: bytes = b"") -> None:
        """Nothing left to send: prepare() wrote and ended the response."""
        if data:
            raise ValueError("a rendered response takes no more data")
        if not self._eof_sent:
            raise RuntimeError("the response has not been prepared")


_BODY = orjson.dumps(Overloaded("too many open connections, retry later").body())
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
    + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


def expect_within(limit: int, refuse: Callable[[int], web.StreamResponse]
                  ) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """A route's `Expect: 100-continue` handler (aiohttp's own, plus the body limit): a
    declared Content-Length over `limit` gets `refuse(length)` at once, before the client
    sends a byte of its body, instead of `100 Continue`."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        if request.version != HttpVersion11:
            return None
        value = request.headers.get("Expect", "")
        if value.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {value}")
        length = request.content_length
        if limit and length is not None and length > limit:
            response = refuse(length)
            response.force_close()  # the body it announced is never read
            return response
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (as aiohttp's own handler does)
        return None

    return expect


def limit_connections(server: web.Server, max_connections: int) -> None:
    """Refuse connections past `max_connections`, before any of their requests is read."""
    admit = server.connection_made

    def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
        admit(handler, transport)
        if len(server.connections) > max_connections:
            transport.write(REFUSAL)
            # Closed on the next turn of the loop, after the handler's task has started: closed
            # here, its connection_lost would run first and the task would fail an assertion
            # (a traceback per refused connection).
            asyncio.get_running_loop().call_soon(transport.close)

    # aiohttp's Server has no hook for this; its handlers call server.connection_made.
    server.connection_made = connection_made  # type: ignore[method-assign]
