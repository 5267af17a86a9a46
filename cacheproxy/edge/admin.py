"""The admin API (/admin/*, bearer token), /metrics, and the status page's data."""

from __future__ import annotations

from aiohttp import web

from backends.base import NamespacePurge
from cacheproxy.cli.store import record_view
from cacheproxy.edge.completions import json_response
from cacheproxy.edge.state import PROXY
from cacheproxy.edge.stats import METRICS, snapshot
from cacheproxy.errors import InvalidRequest, RouteNotFound
from cacheproxy.keys import codec
from cacheproxy.service.memos import decode_body
from cacheproxy.service.namespaces import Registry


async def stats(request: web.Request) -> web.Response:
    """GET /admin/stats: the snapshot plus the namespace registry."""
    data = await snapshot(request.app)
    reports = await Registry(request.app[PROXY].store).report()
    data["namespaces"] = [{"namespace": r.namespace.digest, "model_id": r.namespace.model_id,
                           "state": r.namespace.state, "entries": r.entries, "bytes": r.bytes}
                          for r in reports]
    return json_response(data)


async def public_stats(request: web.Request) -> web.Response:
    """GET /status.json: the aggregate numbers of the status page (no keys, no prompts)."""
    data = await snapshot(request.app)
    data.pop("fingerprint_fields", None)
    return json_response(data)


async def entry(request: web.Request) -> web.Response:
    """GET /admin/entries/{key}: one record with its provenance."""
    key = request.match_info["key"]
    data = await request.app[PROXY].store.get(key)
    if data is None:
        raise RouteNotFound(f"no entry {key}")
    try:
        record = codec.decode(data)
    except codec.CorruptRecord as exc:
        raise InvalidRequest(f"entry {key} is corrupt: {exc}") from None
    return json_response(record_view(key, record))


async def delete_entry(request: web.Request) -> web.Response:
    """DELETE /admin/entries/{key}."""
    key = request.match_info["key"]
    deleted = await request.app[PROXY].store.delete(key)
    if not deleted:
        raise RouteNotFound(f"no entry {key}")
    return json_response({"deleted": key})


async def purge(request: web.Request) -> web.Response:
    """POST /admin/purge {"superseded": true} | {"namespace": "<digest>"} | {"all": true}."""
    body = decode_body(await request.read())
    store = request.app[PROXY].store
    if not isinstance(body, dict) or not isinstance(store, NamespacePurge):
        raise InvalidRequest("expected a JSON object and a store that purges by namespace")
    registry = Registry(store)
    namespaces = await registry.load()
    if body.get("superseded") is True:
        targets = [d for d, ns in namespaces.items() if ns.state == "superseded"]
    elif isinstance(body.get("namespace"), str):
        targets = [body["namespace"]]
    elif body.get("all") is True:
        targets = list(namespaces)
    else:
        raise InvalidRequest("say what to purge: superseded, namespace or all", param="body")
    removed = 0
    for digest in targets:
        removed += await store.purge_namespace(digest)
    await registry.forget([d for d in targets if namespaces.get(d, None) is not None
                           and namespaces[d].state != "current"])
    return json_response({"removed": removed, "namespaces": targets})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus exposition."""
    data = await snapshot(request.app)
    gauges = {"store_errors": data["counters"].get("store_errors", 0),
              "breaker": data["store_breaker"],
              "entries": data["store"].get("entries"), "bytes": data["store"].get("bytes"),
              "l1": data["store"].get("l1"),
              "l1_invalidations": data["store"].get("l1_invalidations"),
              "l1_tracking_restarts": data["store"].get("l1_tracking_restarts"),
              "queued": data["lane"].get("queued", 0),
              "invalidation": {k: v for k, v in data["counters"].items()
                               if k not in ("store_errors", "corrupt_records")}}
    body = request.app[METRICS].render(gauges)
    return web.Response(body=body, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})
