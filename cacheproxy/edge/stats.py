"""The numbers the admin API, the status page and /metrics share."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from backends import redact_url
from backends.base import BackendError, StoreStats
from backends.tiered import TieredBackend
from cacheproxy.edge.state import INVALIDATOR, PROXY, SETTINGS, STARTED
from cacheproxy.observe.metrics import Metrics


async def snapshot(app: web.Application) -> dict[str, Any]:
    """Everything an operator looks at, as plain data (no prompts, no keys)."""
    proxy, tally = app[PROXY], app[METRICS].tally
    store: dict[str, Any] = {"url": redact_url(app[SETTINGS].store)}
    if isinstance(proxy.store, StoreStats):
        try:
            s = await proxy.store.stats()
            store.update(entries=s.entries, bytes=s.bytes, max_bytes=s.max_bytes)
        except BackendError as exc:
            store["error"] = str(exc)
    if isinstance(proxy.store, TieredBackend):
        store.update(l1=proxy.store.coherence, l1_invalidations=proxy.store.invalidations,
                     l1_tracking_restarts=proxy.store.restarts)
    figures = tally.totals()
    totals = figures.by_cache
    served = sum(totals.get(status, 0) for status in ("HIT", "MISS", "COALESCED"))
    fingerprint = proxy.runner.fingerprint()
    return {
        "uptime_s": round(time.time() - app[STARTED], 1),
        "requests": totals,
        "hit_rate": round(totals.get("HIT", 0) / served, 4) if served else None,
        "per_minute": figures.per_minute,
        "saved_tokens": figures.saved_tokens,
        "saved_generation_s": round(figures.saved_seconds, 3),
        "store": store,
        "fingerprint": fingerprint.digest,
        "fingerprint_fields": fingerprint.fields(),
        "lane": proxy.runner.lane_state(),
        "generations": proxy.runner.generations,
        "fills_in_progress": len(proxy.flights),
        "store_breaker": proxy.breaker.state,
        "counters": {**proxy.counters, **app[INVALIDATOR].counters},
    }


METRICS = web.AppKey("metrics", Metrics)
