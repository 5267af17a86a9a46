"""create_app(options, parts): the routes, and the lifecycle of the parts they serve.

The face builds the parts (runner, store, invalidation, service) and hands them over as an
async context: the app enters it at start-up and leaves it at shutdown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog
from aiohttp import web

from cacheproxy.edge import admin, answers, info, status
from cacheproxy.edge.aiohttp_adapter import expect_within
from cacheproxy.edge.apis import APIS, ID_HEADS, Api
from cacheproxy.edge.apis.frame import ResponseIds
from cacheproxy.edge.apis.messages import routes as messages
from cacheproxy.edge.auth import check_admin, client_identity
from cacheproxy.edge.bodies import BodyLimits, BodyReads
from cacheproxy.edge.origin import guarded, site_guard
from cacheproxy.edge.route import (
    Handler,
    Limits,
    Shape,
    edge,
    error_response,
    no_route,
)
from cacheproxy.edge.routing import Router
from cacheproxy.edge.state import (
    BODIES,
    IDENTITY,
    IDS,
    INVALIDATOR,
    METRICS,
    MODELS,
    OPTIONS,
    PROXY,
    ROUTER,
    STARTED,
    STATUS_READER,
    EdgeOptions,
    HitPath,
    Served,
)
from cacheproxy.errors import ExpectationFailed, PayloadTooLarge, ProxyError, Unauthorized
from cacheproxy.observe.metrics import Metrics
from cacheproxy.service.invalidation import Invalidator
from cacheproxy.service.proxy import CachingProxy

log = structlog.get_logger("cacheproxy.edge")

Parts = Callable[[], AbstractAsyncContextManager[list[tuple[CachingProxy, Invalidator]]]]
"""Starts the service and its invalidator of every served model (the first is the default)
on enter, stops what it started on exit."""


def create_app(options: EdgeOptions, parts: Parts) -> web.Application:
    """The aiohttp application."""
    app = web.Application(client_max_size=options.max_body_bytes)
    app[OPTIONS] = options
    app[STARTED] = time.time()
    app[IDS] = ResponseIds(ID_HEADS)
    app[METRICS] = metrics = Metrics()
    hot = HitPath(options, app[IDS])
    app[BODIES] = BodyReads(BodyLimits(timeout=options.body_timeout,
                                       min_rate=options.body_min_rate,
                                       max_reading=options.max_body_reads))
    app.cleanup_ctx.append(_fold_tally)
    app.cleanup_ctx.append(_lifecycle(parts, hot))
    _add_routes(app, options, metrics, hot)
    return app


def _lifecycle(parts: Parts, hot: HitPath) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        async with parts() as served:
            app[PROXY], app[INVALIDATOR] = served[0]
            models: dict[str, Served] = {}
            for proxy, invalidator in served:
                defaults = proxy.runner.defaults()
                for name in (defaults.model_id, *sorted(defaults.aliases)):
                    models.setdefault(name, Served(proxy, invalidator))
            app[MODELS] = models
            app[ROUTER] = hot.router = Router({name: s.proxy for name, s in models.items()},
                                              app[PROXY])
            yield

    return ctx


async def _fold_tally(app: web.Application) -> AsyncIterator[None]:
    """Fold the requests the edge recorded into the metrics every FOLD_EVERY (0.1) s."""
    task = asyncio.create_task(app[METRICS].tally.fold_periodically())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _refusal(limit: int, shape: Shape | None) -> Callable[[int | str], web.StreamResponse]:
    """The 417 or 413 of a route's Expect handler, in its API's error `shape`."""
    def refuse(what: int | str) -> web.StreamResponse:
        error: ProxyError
        if isinstance(what, str):
            error = ExpectationFailed(f"Expect: {what!r} is not supported (100-continue is)")
        else:
            log.info("body_refused", content_length=what, limit=limit)
            error = PayloadTooLarge(f"the request body ({what} bytes) is over the limit of "
                                    f"{limit} bytes")
        return error_response(error, shape)

    return refuse


def _status_guard(options: EdgeOptions, keys: tuple[bytes, ...]) -> dict[str, Any]:
    """Who may read the fleet's traffic figures (`--status-access`)."""
    if (options.status_access == "admin" and not options.admin_token) or \
            (options.status_access == "api-key" and not keys):
        raise ValueError(f"status access {options.status_access!r} without its token")
    if options.status_access == "admin":
        token = options.admin_token.encode()
        return {"guard": lambda request: check_admin(request, token)}
    if options.status_access == "api-key":
        return {"guard": lambda request: client_identity(request, keys)}
    return {}


def _guarded_expect(expect: Callable[[web.Request], Awaitable[web.StreamResponse | None]],
                    guard: Callable[[web.Request], object] | None, shape: Shape | None
                    ) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """A route's Expect handler that runs its guard first: a caller without a key (or from
    a refused site) gets its 401 (403), in the route's API's `shape`, instead of
    `100 Continue`, and is closed unread."""
    if guard is None:
        return expect

    async def checked(request: web.Request) -> web.StreamResponse | None:
        try:
            guard(request)
        except ProxyError as exc:
            response = error_response(exc, shape)
            response.force_close()  # the body it announced is never read (nor lingered on)
            request.content.feed_eof()
            return response
        return await expect(request)

    return checked


def _reader(guard: dict[str, Any]) -> Callable[[web.Request], bool]:
    """Whether a request passes the status guard (any request, when there is none)."""
    check = guard.get("guard")

    def may_read(request: web.Request) -> bool:
        if check is None:
            return True
        try:
            check(request)
        except Unauthorized:
            return False
        return True

    return may_read


def _add_routes(app: web.Application, options: EdgeOptions, metrics: Metrics,
                hot: HitPath) -> None:
    keys = tuple(k.encode() for k in options.api_keys)
    status_guard = _status_guard(options, keys)
    app[STATUS_READER] = _reader(status_guard)

    limits = Limits(options.max_in_flight)

    def api_options(entry: Api | None = None) -> dict[str, Any]:
        header = entry.key_header if entry is not None else ""

        def guard(request: web.Request) -> None:
            request[IDENTITY] = client_identity(request, keys, header=header)

        # Without API keys every caller is the same anonymous identity (IDENTITY unset: "").
        return {"guard": guard if keys else None, "limits": limits,
                "record": metrics.tally.record,
                "shape": entry.error if entry is not None else None}

    api = api_options()
    routes: list[tuple[str, str, Handler, dict[str, Any]]] = [
        ("POST", path, answers.handler(name, hot), api_options(entry))
        for name, entry in APIS.items() for path in entry.paths]
    routes += [
        ("POST", "/v1/messages/count_tokens", messages.count_tokens,
         api_options(APIS["messages"])),
        ("GET", "/v1/models", info.models, api),
        ("GET", "/health", info.health, {}),
        ("GET", "/metrics", status.metrics, status_guard),
        ("GET", "/status.json", status.public_stats, status_guard),
        ("GET", "/", status.status_page, {}),  # a shell: its numbers come from /status.json
    ]
    if options.admin_token:  # no token configured: the admin API does not exist (404)
        token = options.admin_token.encode()
        guard = {"guard": lambda request: check_admin(request, token)}
        routes += [
            ("GET", "/admin/stats", admin.stats, guard),
            ("GET", "/admin/entries/{key:.+}", admin.entry, guard),
            ("DELETE", "/admin/entries/{key:.+}", admin.delete_entry, guard),
            ("POST", "/admin/purge", admin.purge, guard),
            ("POST", "/admin/flush", admin.flush, guard),
            ("POST", "/admin/explain", admin.explain, guard),
        ]
    allowed: dict[str, set[str]] = {}
    site = site_guard(options.bound_host, options.api_keys, hosts=options.allowed_hosts,
                      origins=options.allowed_origins) if options.bound_host else None
    # Every GET route answers HEAD too (its head, no body): Claude Code probes `HEAD /`.
    routes += [("HEAD", path, handler, route_options)
               for method, path, handler, route_options in routes if method == "GET"]
    for method, path, handler, route_options in routes:
        with_site = guarded(route_options, site)
        # Refused before its body is read (401, 403, 413, 417): in the route's API's shape.
        shape = with_site.get("shape")
        expect = expect_within(options.max_body_bytes, _refusal(options.max_body_bytes, shape))
        app.router.add_route(method, path, edge(handler, endpoint=path, **with_site),
                             expect_handler=_guarded_expect(expect, with_site.get("guard"),
                                                            shape))
        allowed.setdefault(path, set()).add(method)
    app.router.add_route("*", "/{tail:.*}", edge(no_route(allowed), **guarded({}, site)))
