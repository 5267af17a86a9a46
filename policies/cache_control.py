"""Cache-Control request directives (RFC 9111) and what they allow. Pure.

- no-store: serve (from the cache or a fresh generation) but store nothing.
- no-cache: never serve a stored answer; generate again and replace the entry.
- only-if-cached: serve a stored answer or fail with 504; never generate.
- max-age=N: serve a stored answer only if it is at most N seconds old.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.status import Reason


@dataclass(frozen=True, slots=True)
class RequestDirectives:
    """The request's Cache-Control directives that change what the proxy does."""

    no_store: bool = False
    no_cache: bool = False
    only_if_cached: bool = False
    max_age: float | None = None


NONE = RequestDirectives()


def parse_cache_control(header: str | None) -> RequestDirectives:
    """Parse a Cache-Control header; unknown directives and bad values are ignored (RFC 9111)."""
    if not header:
        return NONE
    no_store = no_cache = only_if_cached = False
    max_age: float | None = None
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        name = name.strip().lower()
        if name == "no-store":
            no_store = True
        elif name == "no-cache":
            no_cache = True
        elif name == "only-if-cached":
            only_if_cached = True
        elif name == "max-age":
            digits = value.strip().strip('"')
            if digits.isascii() and digits.isdigit():
                max_age = float(digits)
    return RequestDirectives(no_store, no_cache, only_if_cached, max_age)


@dataclass(frozen=True, slots=True)
class Freshness:
    """Whether a stored answer may be served, and why not."""

    usable: bool
    reason: Reason


def stored_answer_usable(directives: RequestDirectives, age: float) -> Freshness:
    """May a stored answer of this age be served under these directives?"""
    if directives.no_cache:
        return Freshness(False, Reason.NO_CACHE)
    if directives.max_age is not None and age > directives.max_age:
        return Freshness(False, Reason.MAX_AGE)
    return Freshness(True, Reason.FRESH)


def response_cache_control(*, stored: bool, ttl: float | None, age: float) -> str:
    """The Cache-Control a response carries: how long a downstream cache may keep it."""
    if not stored:
        return "no-store"
    # Answers of a pinned producer do not go stale: invalidation handles change.
    remaining = 31536000 if ttl is None else max(0, int(ttl - age))
    return f"max-age={remaining}"
