"""Prometheus metrics, one registry per app (no process-global collectors).

Per-request figures are plain counters in `RequestTally`, turned into metric families only
when /metrics is scraped: prometheus_client's Counter and Histogram take a lock per update,
which cost a twentieth of a cache hit. Point-in-time figures are ordinary Gauges.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

MINUTES = 15  # of per-minute counts kept for the status page
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                   10, 30, 60)
_LE = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]


class Buckets:
    """One histogram series: a count per latency bucket (the last is +Inf) and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        """Count one observation (buckets are upper bounds, inclusive)."""
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, count of observations <= le) for every bucket, as Prometheus exposes them."""
        running, out = 0, []
        for le, count in zip(_LE, self.counts, strict=True):
            running += count
            out.append((le, float(running)))
        return out


class RequestTally(Collector):
    """What finished requests did, counted without locks on the event loop's thread: the
    Prometheus series, and the per-cache-status totals and minutes the status page shows."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.by_cache: defaultdict[str, int] = defaultdict(int)  # requests by cache status
        self._minutes: deque[tuple[int, dict[str, int]]] = deque(maxlen=MINUTES)
        self.requests: defaultdict[tuple[str, str, str, int], int] = defaultdict(int)
        self.latency: defaultdict[str, Buckets] = defaultdict(Buckets)
        self.generation = Buckets()
        self.generated_tokens = 0
        self.saved_tokens = 0
        self.saved_seconds = 0.0
        self.coalesced = 0

    def observe(self, endpoint: str, status: int, seconds: float, info: dict[str, Any]) -> None:
        """One finished request (info is the request's cache log fields)."""
        cache = info.get("cache", "NONE")
        self.requests[endpoint, cache, info.get("reason", ""), status] += 1
        self.latency[cache].observe(seconds)
        if not info:
            return  # not an API request: no cache status, tokens or minutes to count
        self.by_cache[cache] += 1
        minute = int(self._clock()) // 60
        if not self._minutes or self._minutes[-1][0] != minute:
            self._minutes.append((minute, {}))
        counts = self._minutes[-1][1]
        counts[cache] = counts.get(cache, 0) + 1
        if cache == "HIT":
            self.saved_tokens += info.get("tokens", 0)
            self.saved_seconds += info.get("runner_ms", 0.0) / 1000
        elif cache == "COALESCED":
            self.coalesced += 1
            self.saved_tokens += info.get("tokens", 0)
        elif cache in ("MISS", "BYPASS") and "runner_ms" in info:
            self.generation.observe(info["runner_ms"] / 1000)
            self.generated_tokens += info.get("tokens", 0)

    def per_minute(self) -> list[dict[str, Any]]:
        """[{minute (epoch s), HIT, MISS, ...}] oldest first, the last MINUTES minutes."""
        return [{"minute": m * 60, **counts} for m, counts in self._minutes]

    def collect(self) -> Iterator[Metric]:
        """The metric families, built at scrape time."""
        requests = CounterMetricFamily(
            "cacheproxy_requests", "Requests by endpoint, cache status, reason and HTTP status",
            labels=["endpoint", "cache", "reason", "status"])
        for (endpoint, cache, reason, status), count in list(self.requests.items()):
            requests.add_metric([endpoint, cache, reason, str(status)], count)
        yield requests
        latency = HistogramMetricFamily("cacheproxy_request_seconds",
                                        "Request latency by cache status", labels=["cache"])
        for cache, buckets in list(self.latency.items()):
            latency.add_metric([cache], buckets.cumulative(), buckets.total)
        yield latency
        generation = HistogramMetricFamily("cacheproxy_generation_seconds",
                                           "Time the runner spent on a generation")
        generation.add_metric([], self.generation.cumulative(), self.generation.total)
        yield generation
        for name, doc, value in (
            ("cacheproxy_generated_tokens", "Completion tokens generated",
             self.generated_tokens),
            ("cacheproxy_saved_tokens", "Completion tokens served from the cache",
             self.saved_tokens),
            ("cacheproxy_saved_generation_seconds", "Generation seconds the hits did not spend",
             self.saved_seconds),
            ("cacheproxy_coalesced_followers",
             "Requests that followed another request's generation", self.coalesced),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    """Every metric cacheproxy exports; the request path only touches `tally`."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.tally = RequestTally()
        r.register(self.tally)
        self.store_errors = Gauge("cacheproxy_store_errors", "Store failures (each a miss)",
                                  registry=r)
        self.breaker_open = Gauge("cacheproxy_store_breaker_open",
                                  "1 while the store's circuit breaker keeps requests off it",
                                  registry=r)
        self.store_entries = Gauge("cacheproxy_store_entries", "Entries in the store",
                                   registry=r)
        self.store_bytes = Gauge("cacheproxy_store_bytes", "Bytes in the store", registry=r)
        self.queue_depth = Gauge("cacheproxy_lane_queue_depth",
                                 "Generations waiting for or running on the lane", registry=r)
        self.invalidation = Gauge("cacheproxy_invalidation_events",
                                  "Reloads, fingerprint changes and purges", ["event"],
                                  registry=r)

    def render(self, gauges: dict[str, Any]) -> bytes:
        """The exposition text, with point-in-time gauges refreshed first."""
        self.store_errors.set(gauges.get("store_errors", 0))
        self.breaker_open.set(1 if gauges.get("breaker") == "open" else 0)
        if gauges.get("entries") is not None:
            self.store_entries.set(gauges["entries"])
            self.store_bytes.set(gauges["bytes"])
        self.queue_depth.set(gauges.get("queued", 0))
        for event, value in gauges.get("invalidation", {}).items():
            self.invalidation.labels(event).set(value)
        return generate_latest(self.registry)
