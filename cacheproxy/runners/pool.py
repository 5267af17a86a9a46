"""A pool of mlx_lm.server upstreams: its members, their health, and the engine it serves.

Pinning rule (`agree`, pure): the pool serves one engine identity. It stays pinned while
any answering member still reports it; a member reporting another one is excluded (logged,
counted), never mixed in. Once no answering member reports it (the whole pool was upgraded),
the identity most members report is adopted, ties broken by the order of `--upstream`.

Health: every member has a checker task owned by the pool. A member that answers is asked
for /health now and then (its engine is checked on every response); a dead or excluded one
is retried with exponential backoff, its engine read again once it answers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field

import structlog

from cacheproxy.errors import ProxyError, UpstreamUnavailable
from cacheproxy.runners.upstream_http import UpstreamClient
from cacheproxy.runners.upstream_wire import EngineIdentity, parse_system_fingerprint

log = structlog.get_logger("cacheproxy.upstream")


@dataclass(eq=False)
class Member:
    """One upstream: its lane (one generation in flight), its health and what it runs."""

    url: str
    index: int
    lane: asyncio.Lock = field(default_factory=asyncio.Lock)
    poke: asyncio.Event = field(default_factory=asyncio.Event)
    load: int = 0  # generations queued on or running in its lane
    busy: bool = False
    up: bool = False
    excluded: bool = False
    identity: EngineIdentity | None = None
    failures: int = 0  # consecutive, for the backoff
    served: int = 0

    @property
    def state(self) -> str:
        """up, down or excluded (answers, but runs another engine than the pool)."""
        return "excluded" if self.excluded else "up" if self.up else "down"

    def describe(self) -> dict[str, object]:
        """The member's state for /health."""
        return {"url": self.url, "state": self.state, "busy": int(self.busy),
                "queued": self.load, "served": self.served, "failures": self.failures,
                "system_fingerprint": self.identity.raw if self.identity else None}


def agree(pinned: EngineIdentity | None, reports: list[EngineIdentity]) -> EngineIdentity | None:
    """The identity the pool serves, given what its answering members report (in order)."""
    if not reports or (pinned is not None and pinned in reports):
        return pinned
    counts = Counter(reports)
    most = max(counts.values())
    return next(r for r in reports if counts[r] == most)


def pick(members: Iterable[Member], tried: Iterable[Member] = ()) -> Member | None:
    """The least busy member that may serve; with none answering, any not excluded
    (a request to a dead upstream fails fast, and one that came back is found at once)."""
    skip = set(tried)
    candidates = [m for m in members if m not in skip and not m.excluded]
    answering = [m for m in candidates if m.up]
    return min(answering or candidates, key=lambda m: (m.load, m.index), default=None)


class Retry(Exception):
    """Nothing was relayed yet: the request may go to another member."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.error = error


async def _nothing() -> None:
    return None


class Pool:
    """The members, their checker tasks, and the engine identity the pool is pinned to."""

    def __init__(self, urls: Iterable[str], client: UpstreamClient, *, device_scope: bool,
                 health_interval: float, backoff: tuple[float, float]) -> None:
        self.members = [Member(url.rstrip("/"), i) for i, url in enumerate(urls)]
        self.pinned: EngineIdentity | None = None
        # Awaited after the pin moved outside a reload (the runner re-keys and announces).
        self.on_move: Callable[[], Awaitable[None]] = _nothing
        self.counters = {"upstream_failures": 0, "upstream_excluded": 0, "engine_changes": 0}
        self._client = client
        self._device_scope = device_scope
        self._interval = health_interval
        self._backoff = backoff
        self._checkers: list[asyncio.Task[None]] = []

    def state(self) -> dict[str, object]:
        """Totals over the pool (queued, busy, lanes serving), then each member."""
        return {
            "queued": sum(m.load for m in self.members),
            "busy": sum(m.busy for m in self.members),
            "lanes": sum(m.up and not m.excluded for m in self.members),
            "upstreams": [m.describe() for m in self.members],
        }

    def identity(self, raw: str) -> EngineIdentity:
        """A system_fingerprint as the identity this pool pins."""
        return parse_system_fingerprint(raw, device_scope=self._device_scope)

    async def refresh(self) -> bool:
        """Check every member and read its engine, then agree; True if the pin moved."""
        await asyncio.gather(*(self._refresh(m) for m in self.members))
        return self.agree()

    def agree(self) -> bool:
        """Re-pin from what the members report, exclude the others; True if the pin moved."""
        reports = [m.identity for m in self.members if m.up and m.identity is not None]
        old, pinned = self.pinned, agree(self.pinned, reports)
        self.pinned = pinned
        for m in self.members:
            excluded = m.identity is not None and pinned is not None and m.identity != pinned
            if excluded and not m.excluded:
                self.counters["upstream_excluded"] += 1
                log.warning("upstream_excluded", upstream=m.url, pinned=pinned and pinned.raw,
                            reports=m.identity and m.identity.raw,
                            reason="engine fingerprint differs from the pool's")
            elif m.excluded and not excluded:
                log.info("upstream_included", upstream=m.url)
            m.excluded = excluded
        moved = old is not None and pinned != old
        if moved:
            self.counters["engine_changes"] += 1
            log.warning("upstream_engine_changed", old=old and old.raw, new=pinned and pinned.raw)
        return moved

    async def reported(self, member: Member, raw: str, *, relayed: bool) -> None:
        """A response carried a system_fingerprint other than the member's last one.

        Raises Retry (or, once text was relayed, the error) if the member is now excluded.
        """
        self.up(member)  # it answers, so its report counts
        member.identity = self.identity(raw)
        if member.identity == self.pinned:
            return  # only a part the key does not pin changed (the platform, unscoped)
        if self.agree():
            await self.on_move()  # before the fill ends: its answer is not stored
            return
        error = UpstreamUnavailable(f"the upstream {member.url} runs another engine ({raw})")
        if relayed:
            raise error
        raise Retry(error)

    def down(self, member: Member, error: str) -> None:
        """A member failed: count it, log the transition, wake its checker."""
        member.failures += 1
        self.counters["upstream_failures"] += 1
        if member.up:
            log.warning("upstream_down", upstream=member.url, error=error)
        member.up = False
        member.poke.set()

    def up(self, member: Member) -> None:
        """A member answered."""
        if not member.up:
            log.info("upstream_up", upstream=member.url)
        member.up, member.failures = True, 0

    async def _refresh(self, member: Member) -> None:
        """Health check, then read the engine (through the lane: it is a generation)."""
        if not await self._client.healthy(member.url):
            self.down(member, "health check failed")
            return
        try:
            async with member.lane:
                raw = await self._client.system_fingerprint(member.url)
        except ProxyError as exc:
            self.down(member, exc.message)
            return
        member.identity = self.identity(raw)
        self.up(member)

    def start_checking(self) -> None:
        """Start one checker task per member."""
        self._checkers = [asyncio.create_task(self._check(m)) for m in self.members]

    async def _check(self, member: Member) -> None:
        first, longest = self._backoff
        while True:
            delay = self._interval if member.up else min(
                longest, first * 2 ** max(0, member.failures - 1))
            member.poke.clear()
            with suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await member.poke.wait()
            if member.up and not member.excluded:
                if not await self._client.healthy(member.url):
                    self.down(member, "health check failed")
                continue
            await self._refresh(member)
            if self.agree():
                await self.on_move()

    async def aclose(self) -> None:
        """Cancel the checker tasks."""
        for task in self._checkers:
            task.cancel()
        await asyncio.gather(*self._checkers, return_exceptions=True)
