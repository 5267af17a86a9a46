"""A store's keys a page at a time, whichever way the store lists them.

Memory and disk list keys in key order (`Scan`: the page after the last key seen); Redis
lists them from a SCAN cursor (`ScanPages`), in its hash table's order, because a page in
key order would cost the whole prefix every time (a sort of 1M keys per 1000-key page:
1.9 s). Who lists keys (verify, export, `purge --all`) needs every key or a sample of
them, not an order, so they go through here and each page costs about one page.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

from backends.base import Backend, Scan, ScanPages

PAGE = 1000


async def page(store: Backend, prefix: str, *, cursor: str = "",
               limit: int = PAGE) -> tuple[list[str], str]:
    """One page of keys starting with prefix, and the cursor of the next ("" at the end)."""
    if isinstance(store, ScanPages):
        return await store.scan_page(prefix, cursor=cursor, limit=limit)
    if isinstance(store, Scan):
        keys = await store.scan(prefix, after=cursor, limit=limit)
        return keys, keys[-1] if len(keys) >= limit else ""
    raise ValueError("this store cannot list its keys")


async def pages(store: Backend, prefix: str, *, cursor: str = "",
                limit: int = PAGE) -> AsyncIterator[list[str]]:
    """The pages of keys starting with prefix from cursor to the end (none empty)."""
    while True:
        keys, cursor = await page(store, prefix, cursor=cursor, limit=limit)
        if keys:
            yield keys
        if not cursor:
            return


async def keys(store: Backend, prefix: str) -> list[str]:
    """Every key starting with prefix, once each, sorted."""
    found: set[str] = set()
    async for chunk in pages(store, prefix):
        found.update(chunk)
    return sorted(found)


async def random_cursor(store: Backend, prefix: str, rng: random.Random) -> str:
    """A cursor at a random point of the keys starting with prefix."""
    if isinstance(store, ScanPages):
        return await store.random_cursor(prefix, rng)
    # Keys are "<namespace>/<32 hex digits>" (cacheproxy.keys.key): a random point among them.
    return f"{prefix}{rng.getrandbits(128):032x}"


async def sample(store: Backend, prefix: str, count: int, rng: random.Random) -> list[str]:
    """count keys starting with prefix (all of them when there are fewer), sorted: the keys
    listed from a random point on, round to the start if need be. A key is a hash of its
    request, so a run of keys is as random a sample of the entries as any; the listing
    stops once it holds count keys, instead of listing the whole prefix."""
    chosen: dict[str, None] = {}  # in listing order, each once
    limit = min(PAGE, max(count, 100))
    for cursor in (await random_cursor(store, prefix, rng), ""):
        async for chunk in pages(store, prefix, cursor=cursor, limit=limit):
            chosen.update(dict.fromkeys(chunk))
            if len(chosen) >= count:
                return sorted(list(chosen)[:count])
    return sorted(chosen)
