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

While nobody reads a generation live (whole answers only), the reader gathers: once the
first event has shown the expected engine, it lets the kernel hold the rest (`gathering`),
so the proxy wakes once per 64 KiB or at the upstream's close instead of once per token
(about half the proxy's CPU on a whole miss). A streaming reader that joins ends it, and
gets what the kernel held at once; so does a cancel. While gathering, silence is told from
the bytes waiting in the socket, and bytes held with none arriving between two looks for
silence are read at once (an upstream slow to close after [DONE], say).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import cast

from cacheproxy.errors import UpstreamTimeout, UpstreamUnavailable
from cacheproxy.runners import gathering
from cacheproxy.runners.http10 import MAX_HEAD, parse_head, request_head, target, tls
from cacheproxy.runners.live import Live
from cacheproxy.runners.upstream_wire import DONE, Delta, delta, parse_line, rejection

LOOK_EVERY = 0.5  # seconds between looks for silence (and for bytes held while gathering)

Take = Callable[[Delta], "bool | None"]
"""Relay one event where it arrives: True to stop reading (the answer is complete), False to
go on, None to defer it (and every later event) to the task iterating `stream`."""


class Unreachable(UpstreamUnavailable):
    """The connection failed: nothing was sent, another member may take the request."""


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
        self._accepted = False  # `take` took an event: the upstream runs the expected engine
        self._may_gather: Live | None = None  # gather once an event is taken, until live
        self._low: gathering.LowWater | None = None  # set while gathering
        self._live: Live | None = None  # the Live whose start ends the gathering
        self._waiting = 0  # bytes in the socket at the last look, while gathering
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
            else:  # taken: the engine is the expected one
                self._accepted = True
                if self._may_gather is not None:
                    self._gather(self._may_gather)

    def gather(self, live: Live) -> None:
        """Let the kernel hold the events until `live` starts, from the first one `take`
        took (which showed the expected engine)."""
        if self._accepted:
            self._gather(live)
        else:
            self._may_gather = live

    def _gather(self, live: Live) -> None:
        self._may_gather = None
        low = gathering.LowWater(self.transport) if self.transport is not None else None
        if gathering.SUPPORTED and low is not None and not live.on and not self.closed and \
                low.set(gathering.GATHER):
            self._low, self._live = low, live
            live.when(self.go_live)

    def go_live(self) -> None:
        """Take every event as it comes again, starting with what the kernel holds."""
        if self._low is not None:
            self._low.set(1)
            self._low = None

    def look(self) -> None:
        """While gathering: bytes arriving in the socket count as heard; bytes held while
        none arrived since the last look are taken now (an upstream slow to close, say)."""
        if self._low is None or self.closed:
            return
        waiting = self._low.waiting()
        if waiting is None:
            return
        if waiting != self._waiting:
            self._waiting, self.heard = waiting, self._loop.time()
        elif waiting:
            self.go_live()

    def release(self) -> None:
        """The reading is over: stop listening for live readers (no cycle left behind)."""
        if self._live is not None:
            self._live.forget(self.go_live)
        self._low = self._live = self._may_gather = self._take = None

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
    """Fails a reading silent for `limit` seconds, detected at its looks: every quarter of
    the limit, at most LOOK_EVERY s apart, instead of a timer re-armed per event. A look
    also lets a gathering reader see bytes arriving, or take those held (`_Reader.look`).
    """

    def __init__(self, reader: _Reader, url: str, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader, self._url, self._limit = reader, url, limit
        self._every = min(limit / 4, LOOK_EVERY)
        self._handle = self._loop.call_later(self._every, self._check)

    def _check(self) -> None:
        self._reader.look()
        if self._loop.time() - self._reader.heard < self._limit:
            self._handle = self._loop.call_later(self._every, self._check)
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
                    ssl=tls() if t.tls else None)
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


async def stream(url: str, path: str, body: bytes, *, limit: float, take: Take,
                 live: Live | None = None) -> AsyncGenerator[list[Delta], None]:
    """Read a streamed completion: each event goes to `take` as it arrives; the events it
    defers are yielded in batches. Ends when `take` stops it or at [DONE]; raises otherwise.
    `limit` seconds: to connect and get the head, and the longest silence in the answer.
    With `live`, the events are gathered until it starts (see the module docstring)."""
    reader = await _connect(url, path, body, limit, take)
    silence = _Silence(reader, url, limit)
    try:
        if reader.status == 200 and live is not None and not live.on:
            reader.gather(live)
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
        reader.release()
        _close(reader)
