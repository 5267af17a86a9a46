"""Prometheus metrics, one registry per app (no process-global collectors)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                   10, 30, 60)


class Metrics:
    """Every metric cacheproxy exports; request-path updates are a few dict lookups."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("cacheproxy_requests", "Requests by endpoint, cache status, "
                                "reason and HTTP status",
                                ["endpoint", "cache", "reason", "status"], registry=r)
        self.latency = Histogram("cacheproxy_request_seconds", "Request latency by cache status",
                                 ["cache"], buckets=LATENCY_BUCKETS, registry=r)
        self.generation = Histogram("cacheproxy_generation_seconds",
                                    "Time the runner spent on a generation",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("cacheproxy_generated_tokens",
                                        "Completion tokens generated", registry=r)
        self.saved_tokens = Counter("cacheproxy_saved_tokens",
                                    "Completion tokens served from the cache", registry=r)
        self.saved_seconds = Counter("cacheproxy_saved_generation_seconds",
                                     "Generation seconds the hits did not spend", registry=r)
        self.coalesced = Counter("cacheproxy_coalesced_followers",
                                 "Requests that followed another request's generation",
                                 registry=r)
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
        # labels() is a dict lookup plus validation: keep the children of every label set seen.
        self._children: dict[tuple[str, str, str, int], Any] = {}
        self._latency_children: dict[str, Any] = {}

    def observe(self, endpoint: str, status: int, seconds: float, info: dict[str, Any]) -> None:
        """One finished request (info is the request's cache log fields)."""
        cache, reason = info.get("cache", "NONE"), info.get("reason", "")
        labels = (endpoint, cache, reason, status)
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.requests.labels(*labels)
        child.inc()
        latency = self._latency_children.get(cache)
        if latency is None:
            latency = self._latency_children[cache] = self.latency.labels(cache)
        latency.observe(seconds)
        if cache == "HIT":
            self.saved_tokens.inc(info.get("tokens", 0))
            self.saved_seconds.inc(info.get("runner_ms", 0.0) / 1000)
        elif cache == "COALESCED":
            self.coalesced.inc()
            self.saved_tokens.inc(info.get("tokens", 0))
        elif cache in ("MISS", "BYPASS") and "runner_ms" in info:
            self.generation.observe(info["runner_ms"] / 1000)
            self.generated_tokens.inc(info.get("tokens", 0))

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
