"""`cacheproxy stats | inspect | purge`: look at and prune a store, with or without a server."""

from __future__ import annotations

import datetime as dt
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from backends import listing
from backends.base import Backend, NamespacePurge, PurgePause, StoreStats
from cacheproxy.keys import codec
from cacheproxy.keys.margin import FRAGILE_BELOW, from_provenance
from cacheproxy.service.cassette import open_store
from cacheproxy.service.namespaces import REGISTRY_KEY, Registry, cache_entries


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True, slots=True)
class Fragile:
    """How `stats` counts fragile entries: a margin under `below`, over up to `sample` entries
    of each namespace (read and decoded: a bounded cost on a large store)."""

    below: float = FRAGILE_BELOW
    sample: int = 1000

    @classmethod
    def of(cls, below: float | None, sample: int | None) -> Fragile:
        """From the command's flags (None: the default)."""
        default = cls()
        return cls(default.below if below is None else below,
                   default.sample if sample is None else sample)


async def fragile_count(store: Backend, namespace: str, fragile: Fragile) -> dict[str, Any]:
    """Of up to `fragile.sample` entries of a namespace: how many were read, how many have a
    margin recorded, and how many of those are fragile."""
    read = measured = count = 0
    keys = await listing.sample(store, namespace + "/", fragile.sample, random.Random()) \
        if fragile.sample else []
    for key in keys:
        data = await store.get(key)
        try:
            record = codec.decode(data) if data is not None else None
        except codec.CorruptRecord:
            record = None
        if record is None:
            continue
        read += 1
        if (margin := from_provenance(record.provenance)) is not None:
            measured += 1
            count += margin.fragile(fragile.below)
    return {"below": fragile.below, "read": read, "with_margin": measured, "fragile": count}


async def stats(url: str, *, as_json: bool, out: TextIO | None = None,
                fragile: Fragile | None = None) -> int:
    """Entries and bytes per namespace, marking the current and the superseded ones, and
    how many of their entries are fragile (`Fragile`)."""
    out = out or sys.stdout  # (looked up per call: a default would be the import's)
    fragile = fragile or Fragile()
    store = await open_store(url, replay=True)  # read only
    unreadable = ""
    try:
        try:
            reports = await Registry(store).report()
        except codec.CorruptRecord as exc:  # the rest of the figures still stand
            reports, unreadable = [], str(exc)
        total = await store.stats() if isinstance(store, StoreStats) else None
        entries = await cache_entries(store, total.entries) if total else None
        fragility = {r.namespace.digest: await fragile_count(store, r.namespace.digest, fragile)
                     for r in reports}
    finally:
        await store.aclose()
    rows: list[dict[str, Any]] = [
        {"namespace": r.namespace.digest, "model_id": r.namespace.model_id,
             "state": r.namespace.state, "entries": r.entries, "bytes": r.bytes,
             "replicas": r.replicas,
             "first_seen": r.namespace.first_seen, "last_seen": r.namespace.last_seen,
             "engine": f"mlx-lm {r.namespace.fields.get('engine_version')} / "
                       f"mlx {r.namespace.fields.get('mlx_version')}",
             "fragile": fragility[r.namespace.digest]}
        for r in reports]
    summary = {"store": url, "entries": entries, "keys": total.entries if total else None,
               "bytes": total.bytes if total else None,
               "max_bytes": total.max_bytes if total else None, "namespaces": rows,
               "hit_miss_counters": "not kept in the store; see GET /health of a running server"}
    if unreadable:
        detail = unreadable.removeprefix("registry unreadable: ")
        summary["registry_error"] = (f"the namespace registry is unreadable ({detail}): "
                                     "entries are counted "
                                     "without their namespaces; the next `cacheproxy serve` "
                                     "rewrites it")
    if as_json:
        print(json.dumps(summary, indent=2), file=out)
        return 1 if unreadable else 0
    spaces = "namespace" if len(rows) == 1 else "namespaces"
    bound = "the server's own bound" if summary["max_bytes"] is None else \
        f"bound {summary['max_bytes']}"  # (Redis: its maxmemory, which it keeps to itself)
    print(f"store {url}: {entries} entries in {len(rows)} {spaces}, {summary['bytes']} bytes "
          f"({bound}); {summary['keys']} keys with the namespace registry", file=out)
    print(f"{'namespace':34} {'state':11} {'replicas':>8} {'entries':>8} {'bytes':>10} "
          f"{'fragile':>9}  model / engine / last seen", file=out)
    for r in rows:
        print(f"{r['namespace']:34} {r['state']:11} {r['replicas']:>8} {r['entries']:>8} "
              f"{r['bytes']:>10} {_fragile_cell(r['fragile']):>9}  {r['model_id']} / "
              f"{r['engine']} / {_when(r['last_seen'])}", file=out)
    print(f"fragile: entries whose smallest near-tie margin is below {fragile.below:g} (of "
          f"those with a margin recorded, among up to {fragile.sample} read per namespace; "
          "--fragile-below, --fragile-sample)", file=out)
    if unreadable:
        print(f"cacheproxy: error: {summary['registry_error']}", file=sys.stderr)
        return 1
    return 0


def _fragile_cell(f: dict[str, Any]) -> str:
    return "-" if not f["with_margin"] else f"{f['fragile']}/{f['with_margin']}"


async def inspect(url: str, key: str, *, as_json: bool, out: TextIO | None = None) -> int:
    """One record with its provenance; the key whole, or any unique prefix of its request
    hash (the access log's 12-digit `key`) or of the whole key."""
    out = out or sys.stdout  # (looked up per call: a default would be the import's)
    store = await open_store(url, replay=True)  # read only
    try:
        data = await store.get(key)
        if data is None:
            key = await _unique(store, key)
            data = await store.get(key)
    finally:
        await store.aclose()
    if data is None:
        print(f"no entry {key}", file=sys.stderr)
        return 1
    try:
        record = codec.decode(data)
    except codec.CorruptRecord as exc:
        print(f"entry {key} is corrupt: {exc}", file=sys.stderr)
        return 1
    view = codec.record_view(key, record)
    if as_json:
        print(json.dumps(view, indent=2, ensure_ascii=False), file=out)
        return 0
    p = record.provenance
    print(f"key          {key}", file=out)
    print(f"created      {_when(p.get('created_at'))}  ({p.get('generation_ms')} ms to generate,"
          f" proxy {p.get('proxy_version')})", file=out)
    print(f"fingerprint  {p.get('fingerprint')}", file=out)
    for name, value in (p.get("fingerprint_fields") or {}).items():
        print(f"  {name:22} {value}", file=out)
    print(f"request      {json.dumps(record.request, ensure_ascii=False)}", file=out)
    o = record.output
    print(f"finish       {o.finish_reason}; {o.prompt_tokens} prompt + {o.completion_tokens} "
          f"completion tokens in {len(o.chunks)} chunks", file=out)
    print(f"text         {o.text!r}", file=out)
    if o.reasoning:
        print(f"reasoning    {o.reasoning!r}", file=out)
    for call in o.tool_calls:
        print(f"tool call    {call.index}: {call.name}({call.arguments})", file=out)
    margin = from_provenance(p)
    print(f"margin       {margin.describe() if margin else 'not recorded'}", file=out)
    return 0


async def _unique(store: Backend, prefix: str) -> str:
    """The one key that `prefix` starts (`<namespace>/<hash...>`), or whose request hash it
    starts, in any registered namespace; `prefix` itself when none does."""
    if not prefix or prefix == REGISTRY_KEY:
        return prefix
    starts = [prefix] if "/" in prefix else \
        [f"{digest}/{prefix}" for digest in await Registry(store).load()]
    found = [key for start in starts for key in await listing.keys(store, start)]
    if len(found) > 1:
        raise ValueError(f"{prefix!r} starts {len(found)} keys ({', '.join(found[:3])}, ...): "
                         "give more digits")
    return found[0] if found else prefix


async def purge(
    url: str, *, superseded: bool, namespace: str | None, key: str | None, everything: bool,
    confirm: Callable[[str], bool], pause: PurgePause | None = None,
) -> int:
    """Remove entries; prints how many went. A namespace's purge awaits `pause` between
    two of its steps (a load test pauses it in turns)."""
    store = await open_store(url)
    try:
        removed = await _purge(store, superseded, namespace, key, everything, confirm, pause)
    finally:
        await store.aclose()
    if removed is None:
        print("nothing removed", file=sys.stderr)
        return 1
    print(f"removed {removed} entries")
    return 0


async def _purge(store: Backend, superseded: bool, namespace: str | None, key: str | None,
                 everything: bool, confirm: Callable[[str], bool],
                 pause: PurgePause | None) -> int | None:
    registry = Registry(store)
    if key is not None:
        return int(await store.delete(key))
    if everything:
        if not confirm("delete every entry of the store"):
            return None
        return await _delete_all(store)
    if not isinstance(store, NamespacePurge):
        raise ValueError("this store cannot purge by namespace")
    if namespace is not None:
        targets = [namespace]
    elif superseded:
        targets = [d for d, ns in (await registry.load()).items() if ns.state == "superseded"]
    else:
        raise ValueError("say what to purge: --superseded, --namespace, --key or --all")
    removed = 0
    for digest in targets:
        removed += await store.purge_namespace(digest, pause=pause)
    await registry.forget(targets)
    return removed


async def _delete_all(store: Backend) -> int:
    removed = 0
    async for keys in listing.pages(store, ""):  # (a key listed twice is deleted once)
        for k in keys:
            removed += int(await store.delete(k) and k != REGISTRY_KEY)
    return removed
