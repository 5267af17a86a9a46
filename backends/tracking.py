"""Client-side caching on the GET lane: the server reports changes to the keys it was read.

A TrackedLane speaks RESP3 and turns `CLIENT TRACKING ON` on each connection it opens, before
any GET: the server remembers the keys that connection read and pushes an invalidation on it
when one changes (written, deleted, expired or evicted, by any client), so a push is read
after the replies to the GETs sent before the change and before those sent after it.
`changed(key)` hears each such key, `changed(None)` a flush; `restarted()` is called each
time tracking starts on a new connection (what an earlier one read is tracked no more).

A tracked connection must be known alive even when no GET is sent (the readers' hot keys
are answered from their own memory): it is pinged every HEARTBEAT seconds when idle, so a
silent network cut is found within HEARTBEAT + DEAD_AFTER timeouts (and `tracking` says
False once a reply is a timeout late), and a server's idle
`timeout` never closes it. When it is lost, the lane reconnects in the background (backoff up
to MAX_RECONNECT_DELAY) without waiting for the next GET; meanwhile changes go unheard.

A server that refuses (older than 6, or an ACL without CLIENT) leaves the lane untracked,
its answer in `refused`.

A Redis Cluster is read through redis-py's own connections, which cannot be tracked: there,
ClusterTracking keeps one lane per primary in broadcasting mode (`CLIENT TRACKING ON BCAST`),
which reports every key written on that primary whoever read it (leases and other
applications' keys too: a few pushes per generation); any of them starting anew counts as a
flush too (reads in flight went out on other connections). The lanes open at the first read.
A read sent by ASK to a node that owns no slot yet (a migration in progress) is not tracked
until that node is a primary the cluster client knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

import hiredis

from backends.resp import Address, GetLane, LaneError, _Replies, command

HEARTBEAT = 0.5
Listener = Callable[[bytes | None], None]
DEAD_AFTER = 3  # socket timeouts without a reply before a tracked connection is given up
FIRST_RECONNECT_DELAY = 0.05
MAX_RECONNECT_DELAY = 2.0


class TrackedLane(GetLane):
    """A GetLane whose every connection is tracked by the server."""

    def __init__(self, address: Address, *, timeout: float, connect_timeout: float,
                 changed: Listener, restarted: Callable[[], None],
                 broadcast: bool = False) -> None:
        super().__init__(address, timeout=timeout, connect_timeout=connect_timeout,
                         dead_after=DEAD_AFTER)
        self._tracking_on = (b"CLIENT", b"TRACKING", b"ON", *((b"BCAST",) if broadcast else ()))
        self._changed = changed
        self._restarted = restarted
        self.refused: str | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._reconnecting: asyncio.Task[None] | None = None

    @classmethod
    def like(cls, lane: GetLane, *, changed: Listener,
             restarted: Callable[[], None]) -> TrackedLane:
        """A tracked lane to the same server, with the same deadlines."""
        return cls(lane._address, timeout=lane._timeout, connect_timeout=lane._connect_timeout,
                   changed=changed, restarted=restarted)

    @property
    def tracking(self) -> bool:
        """Whether the connection open now is tracked and answering (False while none is,
        and while a reply is later than the socket timeout)."""
        replies = self._replies
        if replies is None or replies.on_push is None:
            return False
        return not replies.waiting or time.monotonic() - replies.waiting[0][1] < self._timeout

    def start(self) -> None:
        """Connect in the background now, not at the first GET (and again whenever lost)."""
        self._lost(0.0)

    def close(self) -> None:
        """GetLane.close, and no more heartbeats or reconnects."""
        super().close()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._reconnecting is not None:
            self._reconnecting.cancel()

    async def _set_up(self, replies: _Replies) -> None:
        for request in (command(b"HELLO", b"3"), command(*self._tracking_on)):
            reply = await self._send(replies, request)
            if isinstance(reply, hiredis.ReplyError):
                self.refused = str(reply)
                return
        self.refused = None
        replies.on_push = self._pushed
        replies.on_lost = self._lost
        self._restarted()  # before any GET of this connection is sent
        self._later("heartbeat", HEARTBEAT, self._beat, replies)

    def _pushed(self, push: list[object]) -> None:
        """["invalidate", [key, ...]], or ["invalidate", nil] on a flush."""
        if not push or push[0] != b"invalidate":
            return
        keys = push[1] if len(push) > 1 else None
        if not isinstance(keys, list):
            self._changed(None)
            return
        for key in keys:
            self._changed(key if isinstance(key, bytes) else None)

    def _beat(self, replies: _Replies) -> None:
        """PING an idle tracked connection: a late answer closes it (GetLane's deadlines)."""
        if self._closed or replies is not self._replies or replies.transport is None:
            return
        if not replies.waiting:
            self._send(replies, command(b"PING")).add_done_callback(_ignore)
        self._later("heartbeat", HEARTBEAT, self._beat, replies)

    def _lost(self, delay: float = FIRST_RECONNECT_DELAY) -> None:
        """Reconnect soon, so that tracking resumes even if no GET comes."""
        if not self._closed and "reconnect" not in self._timers:
            self._later("reconnect", delay, self._reconnect, delay)

    def _reconnect(self, delay: float) -> None:
        if self._replies is not None and self._replies.transport is not None:
            return  # a GET reconnected meanwhile
        self._reconnecting = asyncio.ensure_future(self._reconnect_once(delay))

    async def _reconnect_once(self, delay: float) -> None:
        try:
            await self._connect()
        except Exception:  # refused, unreachable, closed: try again later (unless closed)
            self._lost(min(max(2 * delay, FIRST_RECONNECT_DELAY), MAX_RECONNECT_DELAY))
        finally:
            self._reconnecting = None

    def _later(self, name: str, delay: float, callback: Callable[..., None], *args: object
               ) -> None:
        def run() -> None:
            del self._timers[name]
            callback(*args)

        if (old := self._timers.pop(name, None)) is not None:
            old.cancel()
        if not self._closed:
            self._timers[name] = asyncio.get_running_loop().call_later(delay, run)


def _ignore(future: asyncio.Future[object]) -> None:
    """Retrieve a ping's outcome: a failure is the connection's, handled there."""
    with contextlib.suppress(asyncio.CancelledError, LaneError):
        future.result()


class ClusterTracking:
    """Broadcast-mode tracked lanes, one per primary of a Redis Cluster, kept in step with the
    primaries the cluster client knows (`watch`)."""

    def __init__(self, template: Address, *, timeout: float, connect_timeout: float,
                 changed: Listener, restarted: Callable[[], None]) -> None:
        self._template = template  # credentials and TLS; host and port come per primary
        self._timeout, self._connect_timeout = timeout, connect_timeout
        self._changed = changed
        self._on_restart = restarted
        self._lanes: dict[tuple[str, int], TrackedLane] = {}
        self._closed = False

    @property
    def tracking(self) -> bool:
        """Whether every primary's lane is tracked and answering."""
        return bool(self._lanes) and all(lane.tracking for lane in self._lanes.values())

    @property
    def refused(self) -> str | None:
        """A primary's answer when it refused to track."""
        return next((lane.refused for lane in self._lanes.values() if lane.refused), None)

    def watch(self, primaries: list[tuple[str, int]]) -> None:
        """Open lanes to new primaries and close those to primaries gone (needs a loop)."""
        if self._closed:
            return
        wanted = set(primaries)
        for node in [node for node in self._lanes if node not in wanted]:
            self._lanes.pop(node).close()
        for host, port in wanted - set(self._lanes):
            lane = TrackedLane(replace(self._template, host=host, port=port),
                               timeout=self._timeout, connect_timeout=self._connect_timeout,
                               changed=self._changed, restarted=self._restarted,
                               broadcast=True)
            self._lanes[(host, port)] = lane
            lane.start()

    def close(self) -> None:
        """Close every lane."""
        self._closed = True
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()

    def _restarted(self) -> None:
        self._on_restart()
        self._changed(None)  # what was read meanwhile, on other connections, is in doubt
