"""The edge's memo of whole HIT responses: a repeat of a request body answered from the store
is sent again as it was (template, header block, log fields), skipping parse, key, lookup
and rendering, for as long as the service vouches for the HIT it came from (`Held`: the
rule is the service's, in service/memos.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cacheproxy.edge.templates import Template
from cacheproxy.keys.canonical import Route
from cacheproxy.observe.logs import SharedFields
from cacheproxy.service.memos import LRU, MAX_MEMO_BODY
from cacheproxy.service.proxy import CachingProxy, Held


@dataclass(frozen=True, slots=True)
class Repeat:
    """Everything a HIT response to one exact request body needed, kept for its repeats."""

    proxy: CachingProxy  # the service that answered it, and vouches for `hit`
    hit: Held
    route: Route
    ttl: float | None  # the service's (the head holds Cache-Control when it is None)
    template: Template
    head: bytes  # header lines but Age (and Cache-Control under a TTL): they change with time
    log: SharedFields  # the request's cache log fields


RepeatKey = tuple[Route, str, bytes]
"""(route, cache scope, raw body)."""


class Repeats:
    """Remembered HIT responses by (route, cache scope, raw body)."""

    def __init__(self, max_entries: int = 4096, *, max_bytes: int = 64 << 20) -> None:
        self._memo: LRU[RepeatKey, Repeat] = LRU(max_entries, max_bytes=max_bytes)
        # The remembered HIT of exactly this request, if any (the LRU's own method: one
        # call less on every repeat HIT).
        self.get: Callable[[RepeatKey], Repeat | None] = self._memo.get

    def remember(self, memo_key: RepeatKey, repeat: Repeat) -> None:
        """Keep a HIT for the repeats of a small request body."""
        raw = memo_key[2]
        if len(raw) <= MAX_MEMO_BODY:
            size = len(raw) + len(repeat.hit.data) + 2 * len(repeat.template.body)
            self._memo.put(memo_key, repeat, size=size)

    def forget(self, memo_key: RepeatKey) -> None:
        """Drop an entry the service no longer vouches for."""
        self._memo.pop(memo_key)
