"""The namespace registry: one entry per fingerprint digest, kept in the store itself.

Keys are `<digest>/<hash>`, so a namespace is a key prefix. When the producer of a model
id changes (new weights, quant, tokenizer, template or engine version), the namespaces of
that model id under other digests are superseded: never served again, and purged in the
background unless the invalidation policy retains them for audit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from backends.base import Backend, NamespaceStats
from cacheproxy.keys import codec
from cacheproxy.keys.fingerprint import Fingerprint

REGISTRY_KEY = "_registry"  # not a namespace: namespaces are 32 hex digits


@dataclass(frozen=True, slots=True)
class Namespace:
    """What the registry knows about one fingerprint digest."""

    digest: str
    model_id: str
    fields: dict[str, Any]
    first_seen: float
    last_seen: float
    state: str  # "current" | "superseded"
    superseded_at: float | None = None


@dataclass(frozen=True, slots=True)
class NamespaceReport:
    """A registry entry with its live size."""

    namespace: Namespace
    entries: int
    bytes: int


async def cache_entries(store: Backend, keys: int) -> int:
    """The cache entries among the `keys` a store counts: all but the registry record."""
    return keys - (await store.get(REGISTRY_KEY) is not None)


class Registry:
    """Read and update the registry record; every change is one read-modify-write."""

    def __init__(self, store: Backend, *, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock

    async def load(self) -> dict[str, Namespace]:
        """Every registered namespace by digest (a missing or unreadable registry is empty)."""
        data = await self._store.get(REGISTRY_KEY)
        if data is None:
            return {}
        try:
            raw = codec.decode_meta(data)
            return {d: Namespace(**n) for d, n in raw.items()}
        except (codec.CorruptRecord, TypeError) as exc:
            raise codec.CorruptRecord(f"registry unreadable: {exc}") from exc

    async def save(self, namespaces: dict[str, Namespace]) -> None:
        """Write the registry back."""
        await self._store.set(REGISTRY_KEY, codec.encode_meta(
            {d: asdict(n) for d, n in namespaces.items()}))

    async def observe(self, current: Fingerprint) -> list[str]:
        """Register `current` as serving; supersede its model id's other digests; return them."""
        now = self._clock()
        try:
            namespaces = await self.load()
        except codec.CorruptRecord:
            namespaces = {}  # rebuilt from what is serving now
        digest = current.digest
        known = namespaces.get(digest)
        namespaces[digest] = Namespace(
            digest, current.model_id, current.fields(),
            known.first_seen if known else now, now, "current")
        superseded = []
        for other, ns in namespaces.items():
            same_model = ns.model_id == current.model_id
            # Per-device namespaces (--device-scope) of other machines are not superseded.
            same_device = ns.fields.get("device", "") == current.device
            if other != digest and same_model and same_device and ns.state == "current":
                namespaces[other] = replace(ns, state="superseded", superseded_at=now)
                superseded.append(other)
        await self.save(namespaces)
        return superseded

    async def report(self) -> list[NamespaceReport]:
        """Every namespace with its entry count and bytes, newest first."""
        reports = []
        for ns in (await self.load()).values():
            entries, size = 0, 0
            if isinstance(self._store, NamespaceStats):
                entries, size = await self._store.namespace_stats(ns.digest)
            reports.append(NamespaceReport(ns, entries, size))
        return sorted(reports, key=lambda r: -r.namespace.last_seen)

    async def forget(self, digests: list[str]) -> None:
        """Drop registry entries (after their namespaces were purged by hand)."""
        namespaces = await self.load()
        for digest in digests:
            namespaces.pop(digest, None)
        await self.save(namespaces)
