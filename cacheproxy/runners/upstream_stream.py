"""A streamed completion from mlx_lm.server over a bare asyncio protocol, HTTP/1.0.

mlx_lm.server answers HTTP/1.0, one connection per request, and ends a stream with
`data: [DONE]` before closing. A generic client pays, per token, a chain of wake-ups
(socket -> stream reader -> body iterator -> line splitter -> relay task) that was the
largest part of the proxy's CPU on a miss. Here the protocol parses each TCP read where it
lands and hands every event to a synchronous `Take` at once; the relay task wakes only for
the head, the end, an error, or an event `Take` defers to it (it and all later ones are then
yielded in batches, in order). The request goes out as HTTP/1.0 with `Connection: close`, so
a server (or a proxy in between) answers without chunked encoding and closes the connection
after the answer. A stream that closes without [DONE] was broken off: an error.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from functools import cache
from typing import cast
from urllib.parse import urlsplit

from cacheproxy.errors import UpstreamTimeout, UpstreamUnavailable
from cacheproxy.runners.upstream_wire import DONE, Delta, delta, parse_line, rejection

MAX_HEAD = 64 * 1024  # bytes of status line and headers

Take = Callable[[Delta], "bool | None"]
"""Relay one event where it arrives: True to stop reading (the answer is complete), False to
go on, None to defer it (and every later event) to the task iterating `stream`."""


class Unreachable(UpstreamUnavailable):
    """The connection failed: nothing was sent, another member may take the request."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where an upstream URL points: host, port, TLS, and the path prefix."""

    host: str
    port: int
    tls: bool
    prefix: str


@cache
def target(url: str) -> Target:
    """Parse an upstream URL once."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    if parts.hostname is None:
        raise ValueError(f"no host in the upstream URL {url!r}")
    return Target(parts.hostname, parts.port or (443 if tls else 80), tls,
                  parts.path.rstrip("/"))


@cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def request_head(t: Target, path: str, length: int) -> bytes:
    """The head of a JSON POST: HTTP/1.0, no keep-alive."""
    host = t.host if ":" not in t.host else f"[{t.host}]"
    return (f"POST {t.prefix}{path} HTTP/1.0\r\nHost: {host}:{t.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n").encode("latin-1")


def parse_head(head: bytes) -> tuple[int, int | None]:
    """Status and Content-Length of a response head; a chunked or garbled head is an error."""
    lines = head.split(b"\r\n")
    status_line = lines[0].split(None, 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/") or \
            not status_line[1].isdigit():
        raise UpstreamUnavailable(f"the upstream sent no HTTP status line: {lines[0][:80]!r}")
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding" and value.strip().lower() != b"identity":
            raise UpstreamUnavailable("the upstream answered an HTTP/1.0 request with "
                                      f"Transfer-Encoding {value.strip().decode('latin-1')}")
        if name == b"content-length" and value.strip().isdigit():
            length = int(value)
    return int(status_line[1]), length


class _Reader(asyncio.Protocol):
    """One response: its head, then SSE lines parsed into events as the bytes arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop, take: Take) -> None:
        self._loop = loop
        self._take: Take | None = take  # None once an event was deferred
        self.transport: asyncio.Transport | None = None
        self._head = b""
        self._line = b""  # a partial SSE line
        self.status = 0  # set once the head arrived
        self.length: int | None = None
        self.body = b""  # the body of a refusal (any status but 200)
        self.events: list[Delta] = []  # deferred, for the task
        self.done = False  # [DONE] arrived
        self.stopped = False  # `take` said the answer is complete
        self.closed = False
        self.error: Exception | None = None
        self.heard = loop.time()
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Connected."""
        # A TCP transport (uvloop's does not subclass asyncio.Transport, but is one).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        """Bytes arrived: the head, an error body, or events."""
        self.heard = self._loop.time()
        if self.done or self.stopped:
            return
        try:
            if not self.status and not (data := self._take_head(data)):
                return
            if self.status != 200:
                self.body += data
                if self.length is not None and len(self.body) >= self.length:
                    self.done = True
            else:
                self._take_lines(data)
        except Exception as exc:  # a malformed event, or a bug in `take`: the task raises it
            self.fail(exc)
            return
        if self.settled:
            self._wake()

    def _take_head(self, data: bytes) -> bytes:
        """Collect the head; once complete, parse it and return the body bytes after it."""
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD:
                raise UpstreamUnavailable("the upstream sent an over-long response head")
            return b""
        self.status, self.length = parse_head(self._head[:end])
        rest, self._head = self._head[end + 4 :], b""
        self._wake()  # the head alone is news to a waiting reader
        return rest

    def _take_lines(self, data: bytes) -> None:
        *lines, self._line = (self._line + data).split(b"\n")
        for line in lines:
            item = parse_line(line)
            if item is DONE:
                self.done = True
                return
            if not isinstance(item, dict):
                continue
            d = delta(item)
            verdict = None if self._take is None else self._take(d)
            if verdict is None:
                self._take = None
                self.events.append(d)
            elif verdict:
                self.stopped = True
                return

    def connection_lost(self, exc: Exception | None) -> None:
        """The upstream closed (the normal end of an HTTP/1.0 answer) or the link broke."""
        self.closed = True
        if exc is not None and not self.done and self.error is None:
            self.error = UpstreamUnavailable(f"the upstream broke off: {exc!r}")
        self._wake()

    def fail(self, error: Exception) -> None:
        """End the reading with an error."""
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    @property
    def settled(self) -> bool:
        """True when a reader has something to act on."""
        return bool(self.events) or self.done or self.stopped or self.closed or \
            self.error is not None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def news(self) -> None:
        """Wait for the next wake-up: the head, events, the end or an error."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class _Silence:
    """Fails a reading silent for `limit` seconds (detected within 1.25 x).

    It looks four times per limit instead of re-arming a timer per event.
    """

    def __init__(self, reader: _Reader, url: str, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader, self._url, self._limit = reader, url, limit
        self._handle = self._loop.call_later(limit / 4, self._check)

    def _check(self) -> None:
        if self._loop.time() - self._reader.heard < self._limit:
            self._handle = self._loop.call_later(self._limit / 4, self._check)
            return
        self._reader.fail(UpstreamTimeout(
            f"the upstream {self._url} went silent for {self._limit:g} s"))

    def cancel(self) -> None:
        """Stop watching."""
        self._handle.cancel()


async def _connect(url: str, path: str, body: bytes, limit: float, take: Take) -> _Reader:
    """Connect, send the request, wait for the response head (all within `limit` s)."""
    loop = asyncio.get_running_loop()
    t = target(url)
    reader = _Reader(loop, take)
    try:
        async with asyncio.timeout(limit):
            try:
                await loop.create_connection(
                    lambda: reader, t.host, t.port,
                    ssl=_tls() if t.tls else None)
            except OSError as exc:
                raise Unreachable(f"cannot connect to the upstream {url}: {exc}") from None
            if reader.transport is None:
                raise UpstreamUnavailable(f"no transport to the upstream {url}")
            reader.transport.write(request_head(t, path, len(body)) + body)
            while not reader.status and not reader.settled:
                await reader.news()
    except TimeoutError:
        _close(reader)
        raise UpstreamTimeout(f"the upstream {url} did not answer in time") from None
    except BaseException:
        _close(reader)
        raise
    if not reader.status:
        _close(reader)
        raise reader.error or UpstreamUnavailable(f"the upstream {url} closed without answering")
    return reader


def _close(reader: _Reader) -> None:
    if reader.transport is None or reader.closed:
        return
    if reader.done:  # the whole answer is in: a clean close
        reader.transport.close()
    else:
        reader.transport.abort()  # an unfinished answer: mlx_lm.server stops generating


async def stream(url: str, path: str, body: bytes, *, limit: float, take: Take
                 ) -> AsyncGenerator[list[Delta], None]:
    """Read a streamed completion: each event goes to `take` as it arrives; the events it
    defers are yielded in batches. Ends when `take` stops it or at [DONE]; raises otherwise.
    `limit` seconds: to connect and get the head, and the longest silence in the answer."""
    reader = await _connect(url, path, body, limit, take)
    silence = _Silence(reader, url, limit)
    try:
        if reader.status != 200:
            while not (reader.done or reader.closed or reader.error):
                await reader.news()
            raise reader.error or rejection(reader.status, reader.body)
        while True:
            if not reader.settled:
                await reader.news()
                continue
            if reader.events:
                events, reader.events = reader.events, []
                yield events
            elif reader.error is not None:
                raise reader.error
            elif reader.done or reader.stopped:
                return
            else:
                raise UpstreamUnavailable(f"the upstream {url} closed the stream before [DONE]")
    finally:
        silence.cancel()
        _close(reader)
