"""The admin API: /admin/* behind the admin token."""

from __future__ import annotations

from typing import cast, get_args

from aiohttp import web

from backends.base import NamespacePurge
from cacheproxy.edge.auth import identity_of, matches
from cacheproxy.edge.route import json_response
from cacheproxy.edge.state import OPTIONS, PROXY, ROUTER
from cacheproxy.edge.status import snapshot
from cacheproxy.errors import InvalidRequest, RouteNotFound
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import Route
from cacheproxy.keys.fields import decode_body
from cacheproxy.service.cassette import Cassette
from cacheproxy.service.explain import explain as explain_request
from cacheproxy.service.explain import report
from cacheproxy.service.namespaces import Registry

EXPLAIN_KEY = "X-Explain-Api-Key"


async def stats(request: web.Request) -> web.Response:
    """GET /admin/stats: the snapshot plus the namespace registry."""
    data = await snapshot(request.app)
    reports = await Registry(request.app[PROXY].store).report()
    data["namespaces"] = [{"namespace": r.namespace.digest, "model_id": r.namespace.model_id,
                           "state": r.namespace.state, "replicas": r.replicas,
                           "entries": r.entries, "bytes": r.bytes}
                          for r in reports]
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
    return json_response(codec.record_view(key, record))


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


async def flush(request: web.Request) -> web.Response:
    """POST /admin/flush: write a recording (jsonl:// store) to its file now."""
    store = request.app[PROXY].store
    if not isinstance(store, Cassette):
        raise InvalidRequest("this store is no recording (jsonl://): it needs no flush")
    return json_response({"written": await store.flush(), "path": str(store.path),
                          "read_only": store.read_only})


async def explain(request: web.Request) -> web.Response:
    """POST /admin/explain[?api=chat|completions|responses|messages]: why the body sent (as
    a client sends it) misses: its key, other namespaces holding it, the nearest entries and
    the fields they differ in. Under --cache-scope per-key, `X-Explain-Api-Key` names the
    tenant. Nothing is generated or stored."""
    api = request.query.get("api", "chat")
    if api not in get_args(Route):
        raise InvalidRequest(f"api must be one of {', '.join(get_args(Route))}", param="api")
    raw = await request.read()
    options = request.app[OPTIONS]
    scope = ""
    if options.cache_scope == "per-key" and (tenant := request.headers.get(EXPLAIN_KEY)):
        keys = tuple(k.encode() for k in options.api_keys)
        if not matches(tenant.encode(), keys):
            raise InvalidRequest(f"{EXPLAIN_KEY} is no configured API key", param=EXPLAIN_KEY)
        scope = identity_of(tenant.encode())
    proxy = request.app[ROUTER].route(raw, scope)
    # As a request's own parse: a schema-laden body is checked off the loop, within budget.
    parsed = await proxy.memos.parser.parse_off_loop(raw, cast(Route, api),
                                                     proxy.runner.defaults(),
                                                     proxy.options.sampling, scope)
    found = await explain_request(proxy.store, parsed.request,
                                  proxy.runner.fingerprint().digest, scope=scope)
    return json_response(report(found))
