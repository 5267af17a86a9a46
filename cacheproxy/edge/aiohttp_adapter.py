"""The one module that leans on aiohttp's internals: pre-rendered responses, the
connection bounds, and the body limit applied to `Expect: 100-continue`.

Pre-rendered responses: head and body rendered to bytes in advance, written in one call
(a body over PIECE bytes in pieces, each waiting for the client to read: back-pressure).

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

The connection bounds (`ConnectionGuard`): aiohttp's Server has no hook to refuse a
connection, so the guard wraps `Server.connection_made`, which its RequestHandler calls for
every new connection, and tells a connection waiting for a request by its handler's
`_waiter`.

What this relies on is listed in `PRIVATE_ATTRIBUTES` (and `Server.connection_made`, `_lost`);
`missing_private_attributes()` says which of them an installed aiohttp lacks, and a test
fails with that list when an upgrade changes them.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from email.utils import formatdate
from functools import lru_cache
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import SERVER_SOFTWARE, HttpVersion, HttpVersion10, HttpVersion11
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from multidict import CIMultiDict

from cacheproxy.edge.bodies import BodyReads
from cacheproxy.errors import Overloaded, RequestTimeout

_REASONS = {status.value: status.phrase for status in HTTPStatus}  # (as aiohttp's own)
_SERVER = f"Server: {SERVER_SOFTWARE}\r\n".encode()
# Bytes per write of a large body: the default high-water mark of asyncio's and uvloop's
# transports (and aiohttp's StreamWriter drains past the same 64 KiB).
PIECE = 64 << 10
PRIVATE_ATTRIBUTES = {
    "StreamResponse": ("_eof_sent", "_cookies", "_compression", "_chunked", "_keep_alive",
                       "_status", "_reason", "_headers", "_body_length", "_state"),
    "BaseRequest": ("_prepare_hook",),
    "Server": ("connection_made", "connection_lost", "connections"),
    "RequestHandler": ("_waiter", "force_close", "transport", "_request_count",
                       "_current_request", "_messages"),
}


def missing_private_attributes(request: web.BaseRequest) -> list[str]:
    """The aiohttp internals this module relies on that this aiohttp lacks (given any
    request, such as aiohttp.test_utils.make_mocked_request's)."""
    objects = {"StreamResponse": web.StreamResponse(), "BaseRequest": request,
               "Server": web.Server, "RequestHandler": RequestHandler}
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


Body = bytes | Sequence[bytes]
"""A rendered body: bytes, or pieces sent one after another (which may share the bytes of
a template with other responses: a large answer is then not copied per response)."""


class Rendered(web.StreamResponse):
    """A response from a pre-rendered header block and body.

    `head` holds `Name: value\\r\\n` lines (from `header_lines`) without Content-Length,
    Date, Server and Connection, which are added when it is sent (so `headers` must not
    hold them either). `request_id`, when set, is sent as X-Request-Id (the edge sets it;
    cheaper than a header added to `headers`). prepare() sends everything and ends the
    response: no cookies, compression, chunking or later writes. A body up to PIECE bytes
    goes in the head's write; a larger one in pieces, each after the transport drained
    below its high-water mark, so a client that does not read makes the proxy buffer a
    piece or two of its answer, not all of it.
    """

    request_id = ""
    cache_log: dict[str, Any] | None = None  # the access line's cache fields, when known

    def __init__(self, head: bytes, body: Body, *, status: int = 200) -> None:
        if status < 200 or status in (204, 304):
            raise ValueError(f"a {status} response carries no body: not a Rendered one")
        # StreamResponse.__init__'s work for a response without headers, inline (a repeat
        # HIT makes one of these per request)
        self._state: dict[Any, Any] = {}
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._status, self._reason = status, _REASONS.get(status, "")
        self._head = head
        self._rendered = body

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        """Write the whole response, head and body, and end it."""
        if self._eof_sent:
            return None
        if self._cookies or self._compression or self._chunked:
            raise RuntimeError("a rendered response sends no cookies, compression or chunks")
        await request._prepare_hook(self)  # on_response_prepare signals, as aiohttp runs them
        version = request.version
        keep_alive = request.keep_alive if self._keep_alive is None else self._keep_alive
        self._keep_alive = keep_alive
        body = self._rendered
        length = len(body) if isinstance(body, bytes) else sum(map(len, body))
        request_id = self.request_id
        if not request_id.isprintable():  # stricter than _FORBIDDEN, and a tenth of its cost
            raise ValueError("the request id holds a control character such as CR or LF")
        head = (
            _status_line(version, self._status, self._reason), self._head,
            b"X-Request-Id: %s\r\n" % request_id.encode() if request_id else b"",
            header_lines(self._headers.items()) if self._headers else b"",
            _connection(version, keep_alive), b"Content-Length: %d\r\n" % length,
            _date.now(), _SERVER, b"\r\n")
        writer = request.writer
        try:
            if request.method == "HEAD":
                await writer.write_eof(b"".join(head))
            elif isinstance(body, bytes) and length <= PIECE:  # (a HIT: one write, one copy)
                await writer.write_eof(b"".join((*head, body)))  # writes, then drains
            else:
                await _send_in_pieces(writer, b"".join(head), body)
        except OSError as exc:  # the connection is gone (reset, broken pipe, timed out)
            forget_frames(exc)
            raise
        self._eof_sent = True  # so write() after this is refused, as after write_eof()
        self._body_length = length
        return writer

    async def write_eof(self, data: bytes = b"") -> None:
        """Nothing left to send: prepare() wrote and ended the response."""
        if data:
            raise ValueError("a rendered response takes no more data")
        if not self._eof_sent:
            raise RuntimeError("the response has not been prepared")


async def _send_in_pieces(writer: AbstractStreamWriter, head: bytes, body: Body) -> None:
    """Head and body, PIECE bytes a write; each write waits while the transport holds more
    than its high-water mark (StreamWriter.write drains past 64 KiB)."""
    for piece in pieces((head, body) if isinstance(body, bytes) else (head, *body), PIECE):
        await writer.write(piece)
    await writer.write_eof()


def pieces(parts: Iterable[bytes], size: int) -> Iterator[bytes | memoryview]:
    """The concatenation of `parts` in pieces of about `size` bytes: small parts joined,
    large ones sliced without a copy."""
    pending: list[bytes] = []
    held = 0
    for part in parts:
        if len(part) < size:
            pending.append(part)
            held += len(part)
            if held < size:
                continue
        if pending:
            yield b"".join(pending)
            pending, held = [], 0
        if len(part) >= size:
            view = memoryview(part)
            for start in range(0, len(view), size):
                yield view[start:start + size]
    if pending:
        yield b"".join(pending)


def forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of a connection error raised out of a drain (and of the
    connection errors it came from). aiohttp's drain waiter holds the error, whose
    traceback holds the frame that holds the waiter: a cycle that kept every frame the
    error passed (and the answer they hold) alive until the collector ran. The connection
    is gone: nobody reads those tracebacks. The chain stops at the first error that is not
    the connection's (such as a generation's, which others still hold)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while isinstance(cause, OSError) and id(cause) not in seen:
        seen.add(id(cause))
        cause.__traceback__ = None
        cause = cause.__cause__ or cause.__context__


_BODY = orjson.dumps(Overloaded("too many open connections, retry later").body())
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
    + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


def expect_within(limit: int, refuse: Callable[[int | str], web.StreamResponse]
                  ) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """A route's `Expect` handler (aiohttp's own, plus the body limit): a declared
    Content-Length over `limit` gets `refuse(length)` at once, before the client sends a
    byte of its body, instead of `100 Continue`; an expectation other than 100-continue
    gets `refuse(value)` (a 417)."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        if request.version != HttpVersion11:
            return None
        value = request.headers.get("Expect", "")
        length = request.content_length
        if value.lower() != "100-continue" or (limit and length is not None and length > limit):
            response = refuse(value if value.lower() != "100-continue" else length or 0)
            response.force_close()  # the body it announced is never read (nor lingered on)
            request.content.feed_eof()
            return response
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (as aiohttp's own handler does)
        return None

    return expect


class ConnectionGuard:
    """Bounds on the connections of one aiohttp Server.

    - Past `max_connections`, a new connection takes the place of another: the oldest one
      still waiting for its first request's headers (a slowloris), else the body that
      began arriving first (`bodies`, the app's body reads, know the order; a client
      trickling its body: the body is cut, its request answered 408 and its connection
      closed), else the oldest idle keep-alive
      one; only when every connection is inside a request that is being answered is the
      new one refused (503). So clients that never finish their headers or bodies cannot
      lock the others out, and established clients go last. (`cut_bodies=False`: bodies
      are not cut, as before #34; a diagnostic.)
    - Past `max_per_peer` connections from one address, its new connection takes the place
      of one of that address's own, in the same order, else gets the 503: a client opening
      connections in a loop churns its own, never the places of others. (One address may
      be many clients: behind a proxy or NAT, or every local agent on loopback.)
    - A connection whose answer has sat unread in its write buffer for `send_timeout`
      (the buffer never shrank) is aborted, its buffered answer dropped: a client that
      stops reading costs its buffer for that long, never for good.

    aiohttp's Server has no hook for either: `install` wraps `Server.connection_made`
    (which its RequestHandler calls for every new connection) and `watch` polls.
    """

    def __init__(self, server: web.Server, max_connections: int, *,
                 max_per_peer: int | None = None, send_timeout: float = 30.0,
                 counters: dict[str, int] | None = None, cut_bodies: bool = True,
                 bodies: BodyReads | None = None) -> None:
        self._server = server
        self._cut_bodies = cut_bodies
        self._max = max_connections
        self._max_per_peer = max_per_peer  # (None: no bound of its own, as before #34)
        self._peer_of: dict[RequestHandler, str] = {}  # open connections' client addresses
        self._per_peer: Counter[str] = Counter()
        self._send_timeout = send_timeout
        self._unread: dict[RequestHandler, tuple[int, float]] = {}  # buffer size, since
        self._closing: set[RequestHandler] = set()  # evicted, closed on the next turn
        self._bodies = bodies  # the app's body reads (their order: which began first)
        self.counters = counters if counters is not None else {}
        self.counters.update(connections_evicted=0, connections_refused=0, send_timeouts=0,
                             bodies_evicted=0, peer_bound_hits=0)

    def install(self) -> None:
        """Wrap the server's connection_made and connection_lost."""
        admit, lose = self._server.connection_made, self._server.connection_lost

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            admit(handler, transport)
            peer = _address(transport)
            self._peer_of[handler] = peer
            self._per_peer[peer] += 1
            bound = self._max_per_peer
            if bound is not None and self._per_peer[peer] > bound and \
                    self._peer_over(handler, transport, peer, bound):  # (closing counted)
                return  # (room made among its own, or refused: the total did not grow)
            if len(self._server.connections) > self._max:
                self._make_room(handler, transport, self._server.connections, may_defer=True)

        def connection_lost(handler: RequestHandler, exc: BaseException | None = None
                            ) -> None:
            lose(handler, exc)
            peer = self._peer_of.pop(handler, None)
            if peer is not None:
                self._per_peer[peer] -= 1
                if not self._per_peer[peer]:
                    del self._per_peer[peer]

        self._server.connection_made = connection_made  # type: ignore[method-assign]
        self._server.connection_lost = connection_lost  # type: ignore[method-assign]

    def _peer_over(self, handler: RequestHandler, transport: asyncio.Transport,
                   peer: str, bound: int) -> bool:
        """Whether the address's connections, the closing ones aside, are past its bound;
        if so a place is made among its own (or the new one refused)."""
        self._closing.intersection_update(self._server.connections)
        mine = [other for other, address in self._peer_of.items()  # oldest first
                if address == peer and other not in self._closing]
        if len(mine) <= bound:
            return False
        self.counters["peer_bound_hits"] += 1
        self._make_room(handler, transport, mine)
        return True

    def _make_room(self, handler: RequestHandler, transport: asyncio.Transport,
                   among: Iterable[RequestHandler], *, may_defer: bool = False) -> None:
        connections = self._server.connections
        self._closing.intersection_update(connections)  # (those closed are gone from it)
        others = [other for other in among  # oldest first
                  if other is not handler and other not in self._closing]
        fresh = next((other for other in others if _before_a_request(other)), None)
        waiting = next((other for other in others if _waiting_for_a_request(other)), None)
        if fresh is not None:  # no request yet: a slowloris, or a client about to send
            self._evict(fresh)
        elif self._cut_bodies and (body := self._longest_arriving(others)) is not None:
            # (its connection closes once the 408 is sent)
            body.set_exception(RequestTimeout("the request body was cut: it was still "
                                              "arriving when a new connection needed its place"))
            self.counters["bodies_evicted"] += 1
        elif self._cut_bodies and may_defer and waiting is not None and \
                any(map(_starting, others)):
            # A request taken from its queue whose task has not run yet is in no list a
            # body can be found in: decide on the next turn, when it is, rather than evict
            # the idle client (under load many connections are in that turn at once).
            asyncio.get_running_loop().call_soon(self._room_later, handler, transport)
        elif waiting is not None:  # an established client, idle between requests: last
            self._evict(waiting)
        else:
            self._refuse(transport)

    def _longest_arriving(self, among: list[RequestHandler]) -> StreamReader | None:
        """Of the bodies of `among` still arriving, the one that began arriving first, as the
        app's body reads record it (`bodies`); else (none of them read there: parsed and
        queued for their handlers) the oldest connection's. Not the oldest connection's
        first: an established keep-alive client's body is "arriving" for the moment between
        its headers and its body (two segments, tens of ms apart under Nagle and delayed
        ACKs), and was cut before trickles begun long before it (seen in CI: a keep-alive
        client's 408)."""
        if self._bodies is not None and (body := self._bodies.longest(set(among))) is not None:
            return body
        return _arriving(among)

    def _room_later(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        connections = self._server.connections
        if handler in connections and len(connections) > self._max:
            self._make_room(handler, transport, connections)

    def _evict(self, other: RequestHandler) -> None:
        # On the next turn of the loop: a connection accepted in the same turn has not
        # started its task yet (closed now, that task would fail an assertion).
        self._closing.add(other)
        asyncio.get_running_loop().call_soon(other.force_close)
        self.counters["connections_evicted"] += 1

    def _refuse(self, transport: asyncio.Transport) -> None:
        self.counters["connections_refused"] += 1
        transport.write(REFUSAL)
        # Closed on the next turn of the loop, after the handler's task has started: closed
        # here, its connection_lost would run first and the task would fail an assertion (a
        # traceback per refused connection).
        asyncio.get_running_loop().call_soon(transport.close)

    async def watch(self, every: float = 1.0) -> None:
        """Abort the connections whose answers stay unread past send_timeout (until
        cancelled)."""
        while True:
            await asyncio.sleep(every)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """One look at every connection's write buffer."""
        unread: dict[RequestHandler, tuple[int, float]] = {}
        for handler in self._server.connections:
            transport = handler.transport
            size = transport.get_write_buffer_size() if transport is not None else 0
            if not size:
                continue
            before, since = self._unread.get(handler, (size + 1, now))
            since = now if size < before else since  # it shrank: the client reads
            if now - since >= self._send_timeout and transport is not None:
                transport.abort()
                self.counters["send_timeouts"] += 1
                continue
            unread[handler] = (size, since)
        self._unread = unread


def _address(transport: asyncio.BaseTransport) -> str:
    """The client's address (IP without port; "" for a Unix socket)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


def _waiting_for_a_request(handler: RequestHandler) -> bool:
    """Between requests: no request being handled, headers of the next not complete."""
    waiter = handler._waiter
    return waiter is not None and not waiter.done()


def _starting(handler: RequestHandler) -> bool:
    """A request taken from the queue whose handling task has not started (or one that just
    ended): neither its body nor the wait for the next request can be seen."""
    return handler._request_count > 0 and handler._current_request is None and \
        not handler._messages and not _waiting_for_a_request(handler)


def _before_a_request(handler: RequestHandler) -> bool:
    """No request's headers complete yet (a new connection, or a slowloris)."""
    return handler._request_count == 0


def _arriving(handlers: list[RequestHandler]) -> StreamReader | None:
    """The oldest connection's body still arriving (and not cut yet) of `handlers`: of a
    request being handled, or parsed and queued for its handler."""
    for handler in handlers:
        current = handler._current_request
        bodies = [current.content] if current is not None else []
        bodies += [payload for _, payload in handler._messages]
        for body in bodies:
            if not body.is_eof() and body.exception() is None:
                return body
    return None
