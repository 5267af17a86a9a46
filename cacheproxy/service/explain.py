"""Why a request misses: its key, whether that key is stored, which other namespaces hold the
very same request (the producer changed), and the stored entries of its own namespace nearest
to it with the canonical fields that differ.

Bounded: at most `scan` entries of the namespace are read (in the store's key order), so a
large store costs `scan` reads, never a full pass; a registry of N namespaces costs N lookups.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends import listing
from backends.base import Backend
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.differences import differences
from cacheproxy.keys.key import make_key
from cacheproxy.service.namespaces import Registry

SCAN = 2000  # entries of the namespace read at most
NEAREST = 3  # entries shown


@dataclass(frozen=True, slots=True)
class Near:
    """A stored entry of the same namespace and the canonical fields it differs in (a list
    of another length as `path: <this request's count> items vs <the entry's>`)."""

    key: str
    differences: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Explanation:
    """What `explain` found for one request."""

    key: str
    stored: bool
    elsewhere: tuple[tuple[str, str], ...]  # (namespace, its state) holding this very request
    nearest: tuple[Near, ...]
    scanned: int  # entries of the namespace read for `nearest`
    complete: bool  # every entry of the namespace was read


async def explain(store: Backend, request: CanonicalRequest, fingerprint: str, *,
                  scope: str = "", scan: int = SCAN, show: int = NEAREST) -> Explanation:
    """Explain `request` as the runner of `fingerprint` would key it (in cache `scope`)."""
    key = make_key(request, fingerprint, scope=scope)
    if await store.get(key) is not None:
        return Explanation(key, True, (), (), 0, True)
    elsewhere = []
    try:
        namespaces = await Registry(store).load()
    except codec.CorruptRecord:
        namespaces = {}
    for digest, namespace in namespaces.items():
        if digest != fingerprint and \
                await store.get(make_key(request, digest, scope=scope)) is not None:
            elsewhere.append((digest, namespace.state))
    nearest, scanned, complete = await _nearest(store, request, fingerprint, scan)
    return Explanation(key, False, tuple(elsewhere), tuple(nearest[:show]), scanned, complete)


async def _nearest(store: Backend, request: CanonicalRequest, fingerprint: str, scan: int
                   ) -> tuple[list[Near], int, bool]:
    wire = request.wire()
    found: list[Near] = []
    scanned = 0
    async for page in listing.pages(store, f"{fingerprint}/"):
        for key in page:
            if scanned >= scan:
                return _ranked(found), scanned, False
            data = await store.get(key)
            if data is None:
                continue  # gone since the listing
            scanned += 1
            try:
                stored = codec.decode(data).request
            except codec.CorruptRecord:
                continue
            found.append(Near(key, tuple(differences(wire, stored))))  # (ours first)
    return _ranked(found), scanned, True


def _ranked(found: list[Near]) -> list[Near]:
    """Fewest differing fields first (ties in key order)."""
    return sorted(found, key=lambda near: (len(near.differences), near.key))


def report(explanation: Explanation) -> dict[str, object]:
    """The explanation as JSON-able data."""
    e = explanation
    return {"key": e.key, "stored": e.stored,
            "elsewhere": [{"namespace": d, "state": s} for d, s in e.elsewhere],
            "nearest": [{"key": n.key, "differences": list(n.differences)} for n in e.nearest],
            "scanned": e.scanned, "complete": e.complete}
