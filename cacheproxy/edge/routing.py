"""Which served model's proxy answers a request body (`--model ID=PATH`, repeatable)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

import orjson

T = TypeVar("T")


class Router(Generic[T]):
    """The proxy of the model a body names, by id or alias; the default one for a body that
    names none or an unknown one, whose parse then says what is wrong (400 or 404)."""

    def __init__(self, names: Mapping[str, T], default: T) -> None:
        self.default = default
        self._names = dict(names)
        self.single = len(self._names) <= 1  # no body to look at
        self.decodes = 0  # bodies JSON-decoded to route them

    def route(self, raw: bytes) -> T:
        """The proxy that answers `raw`."""
        if self.single:
            return self.default
        self.decodes += 1
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return self.default
        name = body.get("model") if isinstance(body, dict) else None
        found = self._names.get(name) if isinstance(name, str) else None
        return found if found is not None else self.default
