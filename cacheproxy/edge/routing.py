"""Which served model's proxy answers a request body (`--model ID=PATH`, repeatable), with as
few JSON decodes as possible: none on a one-model server; on several, one per body and cache
scope (a body's bytes name its model for good, so a repeat HIT of any model decodes
nothing), but every time for a body over MAX_MEMO_BODY or one that names no served model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

import orjson

from cacheproxy.service.memos import LRU, MAX_MEMO_BODY

T = TypeVar("T")


class Router(Generic[T]):
    """The proxy of the model a body names, by id or alias; the default one for a body that
    names none or an unknown one, whose parse then says what is wrong (400 or 404)."""

    def __init__(self, names: Mapping[str, T], default: T, *, max_entries: int = 4096) -> None:
        self.default = default
        self._names = dict(names)
        # A model answers to its id and aliases: names, not models, may be several.
        self.single = all(target is default for target in self._names.values())
        # Bodies routed, by (cache scope, body): as the parse memo, no tenant's body routes
        # faster because another tenant sent it (under `per-key`, timing tells nothing).
        self._routed: LRU[tuple[str, bytes], T] = LRU(max_entries)
        self.decodes = 0  # bodies JSON-decoded to route them

    def route(self, raw: bytes, scope: str = "") -> T:
        """The proxy that answers `raw` (sent by a caller of cache scope `scope`)."""
        if self.single:
            return self.default
        known = self._routed.get((scope, raw))
        return known if known is not None else self._decoded(raw, scope)

    def _decoded(self, raw: bytes, scope: str) -> T:
        self.decodes += 1
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return self.default
        name = body.get("model") if isinstance(body, dict) else None
        found = self._names.get(name) if isinstance(name, str) else None
        if found is None:
            return self.default
        if len(raw) <= MAX_MEMO_BODY:  # (the parse memo's bound: bigger ones are parsed anew)
            self._routed.put((scope, raw), found, size=len(raw))
        return found
