"""The namespace registry: one entry per fingerprint digest, kept in the store itself.

Keys are `<digest>/<hash>`, so a namespace is a key prefix. When the producer of a model
id changes (new weights, quant, tokenizer, template or engine version), the namespaces of
that model id under other digests are superseded: never served again, and purged in the
background unless the invalidation policy retains them for audit.

A namespace is superseded only once nobody serves it: every serving replica holds a lease
on its namespace (renewed; it lapses when the replica dies, and is released when it stops),
and another namespace of the model id is superseded when it has no live lease and none
for the grace period. So during a rolling upgrade both versions serve their own namespace
and neither purges the other; the old one goes once its last replica has been gone for the
grace period.

Every change is a read-modify-write of one record; on a store with locks (Redis, tiered)
it is made under the store's lock on the record, so two replicas renewing at once never
lose one another's lease or supersession. On a tiered store the record is read and written
in the shared tier only: a replica's L1 copy of it may be stale.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from backends.base import Backend, BackendError, DistributedLock, NamespaceStats
from backends.tiered import TieredBackend
from cacheproxy.keys import codec
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.service.fleet import lock_name

REGISTRY_KEY = "_registry"  # not a namespace: namespaces are 32 hex digits
REGISTRY_LOCK_TTL = 5.0  # far longer than one read-modify-write; a dead holder's lapses


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
    # The serving replicas' leases (replica id -> expiry time); a namespace with a live one
    # is never superseded. Renewed every third of the lease by each replica.
    leases: dict[str, float] = field(default_factory=dict)
    served_until: float | None = None  # the last moment a replica was known to serve it


_FIELDS = frozenset(f.name for f in fields(Namespace))


def _live(leases: dict[str, float], now: float) -> dict[str, float]:
    return {replica: until for replica, until in leases.items() if until > now}


@dataclass(frozen=True, slots=True)
class NamespaceReport:
    """A registry entry with its live size."""

    namespace: Namespace
    entries: int
    bytes: int
    replicas: int = 0  # live leases: replicas serving it now


async def cache_entries(store: Backend, keys: int) -> int:
    """The cache entries among the `keys` a store counts: all but the registry record."""
    return keys - (await store.get(REGISTRY_KEY) is not None)


class Registry:
    """Read and update the registry record; every change is one read-modify-write, under
    the store's lock where it has one."""

    def __init__(self, store: Backend, *, clock: Callable[[], float] = time.time,
                 lock: asyncio.Lock | None = None) -> None:
        self._store = store.l2 if isinstance(store, TieredBackend) else store
        self._clock = clock
        # The models of one process (an invalidator each) share one lock: one change at a time.
        self._local = lock or asyncio.Lock()

    @asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """Hold the store's lock on the record for one read-modify-write (a store without
        locks is one process's, or a disk store whose writers are few and far between)."""
        store = self._store
        async with self._local:
            if not isinstance(store, DistributedLock):
                yield
                return
            name, owner = lock_name(REGISTRY_KEY), os.urandom(8).hex()
            deadline = time.monotonic() + 2 * REGISTRY_LOCK_TTL
            while not await store.try_lock(name, owner, REGISTRY_LOCK_TTL):
                if time.monotonic() > deadline:
                    raise BackendError("the namespace registry stayed locked "
                                       f"for {2 * REGISTRY_LOCK_TTL:.0f} s")
                await asyncio.sleep(0.01)
            try:
                yield
            finally:
                await store.unlock(name, owner)

    async def load(self) -> dict[str, Namespace]:
        """Every registered namespace by digest (a missing or unreadable registry is empty)."""
        data = await self._store.get(REGISTRY_KEY)
        if data is None:
            return {}
        try:
            raw = codec.decode_meta(data)
            # Older records have no leases; a newer version's extra fields are left out.
            return {d: Namespace(**{k: v for k, v in n.items() if k in _FIELDS})
                    for d, n in raw.items()}
        except (codec.CorruptRecord, TypeError) as exc:
            raise codec.CorruptRecord(f"registry unreadable: {exc}") from exc

    async def save(self, namespaces: dict[str, Namespace]) -> None:
        """Write the registry back."""
        await self._store.set(REGISTRY_KEY, codec.encode_meta(
            {d: asdict(n) for d, n in namespaces.items()}))

    async def observe(self, current: Fingerprint, *, replica: str = "", lease_ttl: float = 0.0,
                      grace: float = 0.0) -> list[str]:
        """Register `current` as served by `replica` (a lease of `lease_ttl` seconds, renewed
        by calling again); supersede the model id's other namespaces that no live replica
        serves and none has served for `grace` seconds; return them.

        Without a replica (the CLI, a test) and a grace, the other namespaces nobody holds a
        lease on are superseded at once."""
        async with self._exclusive():
            return await self._observe(current, replica, lease_ttl, grace)

    async def _observe(self, current: Fingerprint, replica: str, lease_ttl: float,
                       grace: float) -> list[str]:
        now = self._clock()
        try:
            namespaces = await self.load()
        except codec.CorruptRecord:
            namespaces = {}  # rebuilt from what is serving now
        digest = current.digest
        known = namespaces.get(digest)
        leases = _live(known.leases if known else {}, now)
        if replica:
            leases[replica] = now + lease_ttl
        namespaces[digest] = Namespace(
            digest, current.model_id, current.fields(),
            known.first_seen if known else now, now, "current", None, leases,
            max([now, *leases.values()]))
        superseded = []
        for other, ns in namespaces.items():
            if other == digest:
                continue
            live = _live(ns.leases, now)
            if live != ns.leases:
                ns = namespaces[other] = replace(ns, leases=live)
            same_model = ns.model_id == current.model_id
            # Per-device namespaces (--device-scope) of other machines are not superseded.
            same_device = ns.fields.get("device", "") == current.device
            # Still served (a replica of another version mid-upgrade), or not for long enough.
            until = ns.served_until if ns.served_until is not None else ns.last_seen
            served = bool(live) or now - until < grace
            if same_model and same_device and ns.state == "current" and not served:
                namespaces[other] = replace(ns, state="superseded", superseded_at=now)
                superseded.append(other)
        await self.save(namespaces)
        return superseded

    async def release(self, digest: str, replica: str, *, replaced: bool = False) -> None:
        """Drop `replica`'s lease on `digest`: it stops serving (the grace period starts), or
        its files were `replaced` (no grace: only other replicas' live leases keep it)."""
        async with self._exclusive():
            namespaces = await self.load()
            ns = namespaces.get(digest)
            if ns is None or replica not in ns.leases:
                return
            now = self._clock()
            leases = {r: t for r, t in ns.leases.items() if r != replica}
            namespaces[digest] = replace(ns, leases=leases,
                                         served_until=0.0 if replaced else now)
            await self.save(namespaces)

    async def register(self, current: Fingerprint) -> None:
        """Register `current` if it is not yet (imported entries), superseding nothing."""
        async with self._exclusive():
            namespaces = await self.load()
            if current.digest not in namespaces:
                now = self._clock()
                namespaces[current.digest] = Namespace(current.digest, current.model_id,
                                                       current.fields(), now, now, "current")
            await self.save(namespaces)

    async def report(self) -> list[NamespaceReport]:
        """Every namespace with its entry count and bytes, newest first."""
        reports = []
        now = self._clock()
        for ns in (await self.load()).values():
            entries, size = 0, 0
            if isinstance(self._store, NamespaceStats):
                entries, size = await self._store.namespace_stats(ns.digest)
            reports.append(NamespaceReport(ns, entries, size, len(_live(ns.leases, now))))
        return sorted(reports, key=lambda r: -r.namespace.last_seen)

    async def forget(self, digests: list[str]) -> None:
        """Drop registry entries (after their namespaces were purged by hand)."""
        async with self._exclusive():
            namespaces = await self.load()
            for digest in digests:
                namespaces.pop(digest, None)
            await self.save(namespaces)
