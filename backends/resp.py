"""Pipelined GETs on one Redis connection: the hit path's Redis call, without redis-py.

Measured here, redis-py's asyncio client spends ~150 µs of CPU per GET (pool checkout,
command packing, its reply parser); GETs written back to back on one connection, their
replies parsed by hiredis and matched in order, cost ~20-30 µs. The GETs of one turn of
the event loop go out in one write. Only GET goes this way,
on single servers over TCP or a Unix socket; everything else (writes, leases, pub/sub,
scans, clusters, TLS) stays on redis-py.

A lane given a listener (`GetLane.track`) speaks RESP3 with `CLIENT TRACKING ON`: the
server remembers the keys this connection read and pushes an invalidation on the same
connection when one changes (written, deleted, expired or evicted, by any client), so a
push is always read after the replies to the GETs sent before the change. The listener
hears each such key, and None ("anything may have changed") on a server flush; `restarted`
is called each time tracking starts on a new connection (what an earlier one read is
tracked no more). When a tracked connection is lost the lane reconnects in the background
(backoff up to MAX_RECONNECT_DELAY), without waiting for the next GET; until then,
invalidations go unheard.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import hiredis

Waiter = tuple["asyncio.Future[object]", float]
Listener = Callable[[bytes | None], None]
FIRST_RECONNECT_DELAY = 0.05
MAX_RECONNECT_DELAY = 2.0


class LaneError(Exception):
    """The server answered with an error, or the connection broke or went silent."""


class LaneTimeout(LaneError):
    """No reply within the deadline: not retried (a stalled server costs one timeout)."""


@dataclass(frozen=True, slots=True)
class Address:
    """Where and how to connect: what redis-py's pool was given for the same URL."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a Unix socket instead of host and port
    db: int = 0
    username: str | None = None
    password: str | None = None


def command(*parts: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


class _Replies(asyncio.Protocol):
    """Feeds hiredis and hands each reply to the oldest waiter, in order."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self.listener: Listener | None = None  # set once the server tracks this connection
        self.on_lost: Callable[[], None] | None = None  # called when a tracked one breaks
        self.waiting: deque[Waiter] = deque()
        self.transport: asyncio.Transport | None = None
        self.outbox: list[bytes] = []  # commands of this turn of the event loop, sent together

    def write_out(self) -> None:
        """Send the commands queued in this turn of the loop in one write."""
        out, self.outbox = self.outbox, []
        if self.transport is None or self.transport.is_closing():
            return  # connection_lost fails the waiters
        try:
            self.transport.write(b"".join(out))
        except (OSError, RuntimeError) as exc:  # uvloop: closed under us by a socket error
            self.fail(LaneError(f"write failed: {exc!r}"))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                if isinstance(reply, hiredis.PushNotification):
                    self._pushed(reply)
                    continue
                waiter = self.waiting.popleft()[0]
                if not waiter.done():  # a cancelled caller's reply is dropped in its turn
                    waiter.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage, or a reply nobody asked
            self.fail(LaneError(f"protocol error: {exc!r}"))

    def _pushed(self, push: list[object]) -> None:
        """An invalidation: ["invalidate", [key, ...]], or ["invalidate", nil] on a flush."""
        if self.listener is None or not push or push[0] != b"invalidate":
            return
        keys = push[1] if len(push) > 1 else None
        if not isinstance(keys, list):
            self.listener(None)
            return
        for key in keys:
            self.listener(key if isinstance(key, bytes) else None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(LaneError(f"connection lost: {exc!r}" if exc else "connection closed"))

    def fail(self, error: LaneError) -> None:
        """Close the connection; every waiting caller gets `error`."""
        transport, self.transport = self.transport, None
        self.outbox.clear()
        if transport is not None:
            transport.close()
        tracked, self.listener = self.listener is not None, None
        if tracked and self.on_lost is not None:
            self.on_lost()
        while self.waiting:
            waiter = self.waiting.popleft()[0]
            if not waiter.done():
                waiter.set_exception(error)


class GetLane:
    """GETs pipelined on one lazily opened connection, with a reply deadline."""

    def __init__(self, address: Address, *, timeout: float, connect_timeout: float) -> None:
        self._address = address
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._replies: _Replies | None = None
        self._connecting = asyncio.Lock()
        self._watchdog: asyncio.TimerHandle | None = None
        self._listener: Listener | None = None
        self._restarted: Callable[[], None] = _nothing
        self.refused: str | None = None  # why the server would not track, if it would not
        self._closed = False
        self._reconnect: asyncio.TimerHandle | None = None
        self._reconnecting: asyncio.Task[None] | None = None

    def track(self, listener: Listener, restarted: Callable[[], None]) -> None:
        """From the next connection on, ask the server to track the keys read (see the
        module docstring); a connection open now is closed so that the next GET opens one."""
        self._listener = listener
        self._restarted = restarted
        if self._replies is not None:
            self._replies.fail(LaneError("reconnecting to track keys"))

    async def get(self, key: str) -> bytes | None:
        """The value under key or None; LaneError on any failure (GET is retried once on a
        connection that broke before answering: a server restart heals at once)."""
        for attempt in (1, 2):
            replies = self._replies
            fresh = replies is None or replies.transport is None
            if fresh:
                replies = await self._connect()
            try:
                reply = await self._send(replies, command(b"GET", key.encode()))
            except LaneTimeout:
                raise
            except LaneError:
                if fresh or attempt == 2:
                    raise
                continue
            if isinstance(reply, hiredis.ReplyError):
                raise LaneError(f"the server answered: {reply}")
            if reply is not None and not isinstance(reply, bytes):
                raise LaneError(f"GET answered {type(reply).__name__}")
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Drop the connection (waiting callers get LaneError) and stop reconnecting."""
        self._closed = True
        if self._reconnect is not None:
            self._reconnect.cancel()
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        if self._replies is not None:
            self._replies.fail(LaneError("closed"))
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _send(self, replies: _Replies | None, request: bytes) -> Awaitable[object]:
        if replies is None or replies.transport is None or replies.transport.is_closing():
            raise LaneError("not connected")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[object] = loop.create_future()
        if not replies.outbox:  # the first of this turn of the loop: write them all after it
            loop.call_soon(replies.write_out)
        replies.outbox.append(request)
        replies.waiting.append((waiter, time.monotonic()))
        if self._watchdog is None:
            self._watchdog = loop.call_later(self._timeout, self._check_deadline)
        return waiter

    def _check_deadline(self) -> None:
        """One timer per lane, not per GET: fail the connection if its oldest reply is late."""
        self._watchdog = None
        replies = self._replies
        if replies is None or not replies.waiting:
            return
        late = time.monotonic() - replies.waiting[0][1]
        if late >= self._timeout:
            replies.fail(LaneTimeout(f"TimeoutError: no reply within {self._timeout:g}s"))
            return
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(self._timeout - late, self._check_deadline)

    async def _connect(self) -> _Replies:
        async with self._connecting:  # callers arriving meanwhile share one connection
            if self._replies is not None and self._replies.transport is not None:
                return self._replies
            try:
                async with asyncio.timeout(self._connect_timeout):
                    replies = await self._open()
            except TimeoutError:
                raise LaneError(f"TimeoutError: no connection within "
                                f"{self._connect_timeout:g}s") from None
            except OSError as exc:
                raise LaneError(f"{type(exc).__name__}: {exc}") from exc
            self._replies = replies
            return replies

    async def _open(self) -> _Replies:
        loop = asyncio.get_running_loop()
        a = self._address
        factory: Callable[[], _Replies] = _Replies
        if a.path is not None:
            _, replies = await loop.create_unix_connection(factory, a.path)
        else:
            _, replies = await loop.create_connection(factory, a.host, a.port)
        hello = []
        if a.username or a.password is not None:  # as redis-py: AUTH [user] password
            user = [a.username.encode()] if a.username else []
            hello.append(command(b"AUTH", *user, (a.password or "").encode()))
        if a.db:
            hello.append(command(b"SELECT", str(a.db).encode()))
        try:
            for request in hello:
                reply = await self._send(replies, request)
                if isinstance(reply, hiredis.ReplyError):
                    raise LaneError(f"the server refused the connection set-up: {reply}")
            if self._listener is not None:
                await self._start_tracking(replies, self._listener)
        except BaseException as exc:  # refused, timed out or cancelled: close what we opened
            replies.fail(exc if isinstance(exc, LaneError) else LaneError("set-up abandoned"))
            raise
        return replies

    async def _start_tracking(self, replies: _Replies, listener: Listener) -> None:
        """RESP3 and CLIENT TRACKING ON; a server that refuses either (older than 6, or an
        ACL without CLIENT) leaves the lane untracked, its reason in `refused`."""
        for request in (command(b"HELLO", b"3"), command(b"CLIENT", b"TRACKING", b"ON")):
            reply = await self._send(replies, request)
            if isinstance(reply, hiredis.ReplyError):
                self.refused = str(reply)
                return
        self.refused = None
        replies.listener = listener
        replies.on_lost = self._tracking_lost
        self._restarted()  # before any GET of this connection is sent

    def _tracking_lost(self, delay: float = FIRST_RECONNECT_DELAY) -> None:
        """Reconnect soon, so that tracking resumes even if no GET comes."""
        if self._closed or self._reconnect is not None:
            return
        loop = asyncio.get_running_loop()
        self._reconnect = loop.call_later(delay, self._start_reconnect, delay)

    def _start_reconnect(self, delay: float) -> None:
        self._reconnect = None
        if self._closed or (self._replies is not None and self._replies.transport is not None):
            return  # a GET reconnected meanwhile
        self._reconnecting = asyncio.ensure_future(self._reconnect_once(delay))

    async def _reconnect_once(self, delay: float) -> None:
        try:
            await self._connect()
        except LaneError:
            self._tracking_lost(min(2 * delay, MAX_RECONNECT_DELAY))
        finally:
            self._reconnecting = None


def _nothing() -> None:
    pass
