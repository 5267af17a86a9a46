"""The names of cache outcomes: one enum for the status, one for the reason. Pure.

These exact values are what the `X-Cache` header, the access log line and the metric labels
show (`X-Cache: MISS; reason=no-store`), so a status or reason is never spelled as a bare
string anywhere else.
"""

from __future__ import annotations

from enum import StrEnum


class CacheStatus(StrEnum):
    """Where an answer came from."""

    HIT = "HIT"  # the stored answer
    MISS = "MISS"  # generated for this request (and stored, unless it may not be)
    COALESCED = "COALESCED"  # followed another request's generation, here or on a replica
    BYPASS = "BYPASS"  # generated without the cache: never stored, never served from it


class Reason(StrEnum):
    """Why the status is what it is (the sampling decision, or the directive that bent it)."""

    GREEDY = "greedy"
    FORCED_GREEDY = "forced-greedy"
    SEEDED = "seeded"
    UNSEEDED_SAMPLING = "unseeded-sampling"
    SAMPLING = "sampling"
    STORE_UNAVAILABLE = "store-unavailable"  # the store is down (and a MISS: not stored)
    NO_CACHE = "no-cache"
    MAX_AGE = "max-age"
    NO_STORE = "no-store"
    FRESH = "fresh"  # a stored answer these directives allow
    NOT_RECORDED = "not-recorded"  # a replaying server has no recorded answer
    STORE_FULL = "store-full"  # generated, not stored: the store takes nothing new
    STORE_READ_ONLY = "store-read-only"  # generated, not stored: the store is read-only
