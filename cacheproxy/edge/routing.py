"""Which served model's proxy answers a request body (`--model ID=PATH`, repeatable), with as
few JSON decodes as possible: none on a one-model server, one per body on several (a body's
bytes name its model for good, so a repeat HIT of any model decodes nothing)."""

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
        self._routed: LRU[bytes, T] = LRU(max_entries)  # bodies (up to MAX_MEMO_BODY) routed
        self.decodes = 0  # bodies JSON-decoded to route them

    def route(self, raw: bytes) -> T:
        """The proxy that answers `raw`."""
        if self.single:
            return self.default
        known = self._routed.get(raw)
        return known if known is not None else self._decoded(raw)

    def _decoded(self, raw: bytes) -> T:
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
            self._routed.put(raw, found, size=len(raw))
        return found
