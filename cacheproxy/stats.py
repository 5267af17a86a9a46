"""The numbers the admin API, the status page and /metrics share."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from backends import redact_url
from backends.base import BackendError, StoreStats
from cacheproxy.state import INVALIDATOR, PROXY, SETTINGS, STARTED

MINUTES = 15


class RequestStats:
    """Requests by cache status, in total and per minute over the last MINUTES minutes."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.totals: Counter[str] = Counter()
        self.saved_tokens = 0
        self.saved_seconds = 0.0
        self._minutes: deque[tuple[int, Counter[str]]] = deque(maxlen=MINUTES)

    def observe(self, info: dict[str, Any]) -> None:
        """Count one finished /v1 request."""
        cache = info.get("cache", "NONE")
        self.totals[cache] += 1
        if cache in ("HIT", "COALESCED"):
            self.saved_tokens += int(info.get("tokens", 0))
        if cache == "HIT":
            self.saved_seconds += float(info.get("runner_ms", 0.0)) / 1000
        minute = int(self._clock() // 60)
        if not self._minutes or self._minutes[-1][0] != minute:
            self._minutes.append((minute, Counter()))
        self._minutes[-1][1][cache] += 1

    def per_minute(self) -> list[dict[str, Any]]:
        """[{minute (epoch s), HIT, MISS, ...}] oldest first."""
        return [{"minute": m * 60, **counts} for m, counts in self._minutes]


async def snapshot(app: web.Application) -> dict[str, Any]:
    """Everything an operator looks at, as plain data (no prompts, no keys)."""
    proxy, stats = app[PROXY], app[REQUEST_STATS]
    store: dict[str, Any] = {"url": redact_url(app[SETTINGS].store)}
    if isinstance(proxy.store, StoreStats):
        try:
            s = await proxy.store.stats()
            store.update(entries=s.entries, bytes=s.bytes, max_bytes=s.max_bytes)
        except BackendError as exc:
            store["error"] = str(exc)
    served = stats.totals["HIT"] + stats.totals["MISS"] + stats.totals["COALESCED"]
    fingerprint = proxy.runner.fingerprint()
    return {
        "uptime_s": round(time.time() - app[STARTED], 1),
        "requests": dict(stats.totals),
        "hit_rate": round(stats.totals["HIT"] / served, 4) if served else None,
        "per_minute": stats.per_minute(),
        "saved_tokens": stats.saved_tokens,
        "saved_generation_s": round(stats.saved_seconds, 3),
        "store": store,
        "fingerprint": fingerprint.digest,
        "fingerprint_fields": fingerprint.fields(),
        "lane": proxy.runner.lane_state(),
        "generations": proxy.runner.generations,
        "fills_in_progress": len(proxy.flights),
        "store_breaker": proxy.breaker.state,
        "counters": {**proxy.counters, **app[INVALIDATOR].counters},
    }


REQUEST_STATS = web.AppKey("request_stats", RequestStats)
