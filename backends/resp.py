"""Pipelined GETs on one Redis connection: the hit path's Redis call, without redis-py.

Measured here, redis-py's asyncio client spends ~150 µs of CPU per GET (pool checkout,
command packing, its reply parser); GETs written back to back on one connection, their
replies parsed by hiredis and matched in order, cost ~20-30 µs. The GETs of one turn of
the event loop go out in one write. Only GET goes this way, on single servers over TCP
(plain or TLS) or a Unix socket, and a purge's SCAN and UNLINK, on a lane of their own
(`call`); everything else (writes, leases, pub/sub, listing, clusters) stays on redis-py.

Deadlines: a caller waits at most `timeout` for its reply. The connection is closed (and
the next call opens another) when its oldest unanswered command is `dead_after` timeouts
old: at once by default; a lane that holds on to its connection (backends/tracking.py,
client-side caching) keeps it through a shorter stall, a late reply dropped in its turn.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import hiredis

Waiter = tuple["asyncio.Future[object]", float]


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
    tls: ssl.SSLContext | None = None  # rediss://: the context redis-py builds for the URL


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
        self.waiting: deque[Waiter] = deque()
        self.transport: asyncio.Transport | None = None
        self.outbox: list[bytes] = []  # commands of this turn of the event loop, sent together
        self.on_push: Callable[[list[object]], None] | None = None  # RESP3 pushes, if any
        self.on_lost: Callable[[], None] | None = None

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
                    if self.on_push is not None:
                        self.on_push(reply)
                    continue
                waiter = self.waiting.popleft()[0]
                if not waiter.done():  # a cancelled or late caller's reply is dropped in turn
                    waiter.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage, or a reply nobody asked
            self.fail(LaneError(f"protocol error: {exc!r}"))
        except Exception as exc:  # a push listener's fault: start afresh
            self.fail(LaneError(f"push not handled: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(LaneError(f"connection lost: {exc!r}" if exc else "connection closed"))

    def fail(self, error: LaneError) -> None:
        """Close the connection; every waiting caller gets `error`."""
        transport, self.transport = self.transport, None
        self.outbox.clear()
        if transport is not None:
            transport.close()
        lost, self.on_lost, self.on_push = self.on_lost, None, None
        if lost is not None:
            lost()
        while self.waiting:
            waiter = self.waiting.popleft()[0]
            if not waiter.done():
                waiter.set_exception(error)


class GetLane:
    """GETs pipelined on one lazily opened connection, with a reply deadline."""

    def __init__(self, address: Address, *, timeout: float, connect_timeout: float,
                 dead_after: int = 1) -> None:
        self._address = address
        self._dead_after = dead_after
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._replies: _Replies | None = None
        self._connecting = asyncio.Lock()
        self._watchdog: asyncio.TimerHandle | None = None
        self._closed = False

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
            return _value(reply)
        raise AssertionError("unreachable")  # pragma: no cover

    async def get_with_pttl(self, key: str) -> tuple[bytes | None, int]:
        """GET and PTTL in one write: the value and its milliseconds to live (-1: none,
        -2: no key); retried as get() is. (get() keeps its own copy of the loop: folding both
        into one helper cost the hit path's GET ~1 µs of its ~10 here.)"""
        name = key.encode()
        for attempt in (1, 2):
            replies = self._replies
            fresh = replies is None or replies.transport is None
            if fresh:
                replies = await self._connect()
            try:
                value, pttl = await asyncio.gather(
                    self._send(replies, command(b"GET", name)),
                    self._send(replies, command(b"PTTL", name)))
            except LaneTimeout:
                raise
            except LaneError:
                if fresh or attempt == 2:
                    raise
                continue
            if not isinstance(pttl, int):
                raise LaneError(f"PTTL answered {pttl!r}")
            return _value(value), pttl
        raise AssertionError("unreachable")  # pragma: no cover

    async def call(self, *parts: bytes) -> object:
        """One command's reply, not retried; LaneError on any failure or error reply. For
        the store's own background work on a lane of its own (a purge's SCAN and UNLINK)."""
        replies = self._replies
        if replies is None or replies.transport is None:
            replies = await self._connect()
        reply = await self._send(replies, command(*parts))
        if isinstance(reply, hiredis.ReplyError):
            raise LaneError(f"the server answered: {reply}")
        return reply

    def sibling(self) -> GetLane:
        """A lane of its own (another connection) to the same server, same deadlines."""
        return GetLane(self._address, timeout=self._timeout,
                       connect_timeout=self._connect_timeout)

    def close(self) -> None:
        """Drop the connection (waiting callers get LaneError); later calls raise."""
        self._closed = True
        if self._replies is not None:
            self._replies.fail(LaneError("closed"))
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _send(self, replies: _Replies | None, request: bytes) -> asyncio.Future[object]:
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
        """One timer per lane, not per GET: late callers get LaneTimeout; a connection whose
        oldest command has waited dead_after timeouts is closed."""
        self._watchdog = None
        replies = self._replies
        if replies is None or not replies.waiting:
            return
        now = time.monotonic()
        dead_after = self._dead_after * self._timeout
        oldest = now - replies.waiting[0][1]
        if oldest >= dead_after:
            replies.fail(LaneTimeout(f"TimeoutError: no reply within {dead_after:g}s"))
            return
        wake = min(dead_after - oldest, self._timeout)  # a GET sent next is checked in time
        for waiter, sent in replies.waiting:  # oldest first: stop at the first one in time
            if now - sent < self._timeout:
                wake = min(wake, self._timeout - (now - sent))
                break
            if not waiter.done():
                waiter.set_exception(LaneTimeout(f"TimeoutError: no reply within "
                                                 f"{self._timeout:g}s"))
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(wake, self._check_deadline)

    async def _connect(self) -> _Replies:
        if self._closed:
            raise LaneError("closed")
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
            if self._closed:  # closed while this connection was being opened
                replies.fail(LaneError("closed"))
                raise LaneError("closed")
            self._replies = replies
            return replies

    async def _open(self) -> _Replies:
        loop = asyncio.get_running_loop()
        a = self._address
        factory: Callable[[], _Replies] = _Replies
        if a.path is not None:
            _, replies = await loop.create_unix_connection(factory, a.path)
        else:
            _, replies = await loop.create_connection(
                factory, a.host, a.port, ssl=a.tls, server_hostname=a.host if a.tls else None)
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
            await self._set_up(replies)
        except BaseException as exc:  # refused, timed out or cancelled: close what we opened
            replies.fail(exc if isinstance(exc, LaneError) else LaneError("set-up abandoned"))
            raise
        return replies

    async def _set_up(self, replies: _Replies) -> None:
        """More set-up on a new connection, before any GET is sent (see tracking.py)."""


def _value(reply: object) -> bytes | None:
    if isinstance(reply, hiredis.ReplyError):
        raise LaneError(f"the server answered: {reply}")
    if reply is not None and not isinstance(reply, bytes):
        raise LaneError(f"GET answered {type(reply).__name__}")
    return reply
