"""create_app(settings): routes and the lifecycle of runner, store, invalidation and fills."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from backends import open_backend, redact_url
from backends.base import Backend
from cacheproxy.cli.settings import Settings
from cacheproxy.edge import admin
from cacheproxy.edge import completions as handlers
from cacheproxy.edge.auth import check_admin, client_identity
from cacheproxy.edge.route import Handler, Limits, edge, no_route
from cacheproxy.edge.state import HOT, IDENTITY, INVALIDATOR, PROXY, SETTINGS, STARTED, Hot
from cacheproxy.edge.stats import METRICS
from cacheproxy.edge.status_page import status_page
from cacheproxy.observe.metrics import Metrics
from cacheproxy.runners.base import Runner
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from cacheproxy.runners.upstream import UpstreamOptions, UpstreamRunner
from cacheproxy.service.invalidation import Invalidator
from cacheproxy.service.memos import ParseMemo
from cacheproxy.service.proxy import CachingProxy, ServiceOptions

log = structlog.get_logger("cacheproxy.edge.app")


def create_app(
    settings: Settings, *, runner: Runner | None = None, store: Backend | None = None
) -> web.Application:
    """The aiohttp application; a given (already started) runner or store is used as is."""
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[STARTED] = time.time()
    app[HOT] = Hot(parser=ParseMemo(max_tokens_cap=settings.max_tokens_cap))
    app[METRICS] = metrics = Metrics()
    app.cleanup_ctx.append(_fold_tally)
    app.cleanup_ctx.append(_lifecycle(settings, runner, store))
    _add_routes(app, settings, metrics)
    return app


async def _fold_tally(app: web.Application) -> AsyncIterator[None]:
    """Fold the requests the edge recorded into the metrics every FOLD_EVERY (0.1) s."""
    task = asyncio.create_task(app[METRICS].tally.fold_periodically())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _add_routes(app: web.Application, settings: Settings, metrics: Metrics) -> None:
    keys = tuple(k.encode() for k in settings.api_keys)

    def api_guard(request: web.Request) -> None:
        request[IDENTITY] = client_identity(request, keys)

    limits = Limits(settings.max_in_flight)
    # Without API keys every caller is the same anonymous identity (IDENTITY unset: "").
    api = {"guard": api_guard if keys else None, "limits": limits,
           "record": metrics.tally.record}
    routes: list[tuple[str, str, Handler, dict[str, Any]]] = [
        ("POST", "/v1/chat/completions", handlers.chat_completions, api),
        ("POST", "/v1/completions", handlers.completions, api),
        ("GET", "/v1/models", handlers.models, api),
        ("GET", "/health", handlers.health, {}),
        ("GET", "/metrics", admin.metrics, {}),
        ("GET", "/status.json", admin.public_stats, {}),
        ("GET", "/", status_page, {}),
    ]
    if settings.admin_token:  # no token configured: the admin API does not exist (404)
        token = settings.admin_token.encode()
        guard = {"guard": lambda request: check_admin(request, token)}
        routes += [
            ("GET", "/admin/stats", admin.stats, guard),
            ("GET", "/admin/entries/{key:.+}", admin.entry, guard),
            ("DELETE", "/admin/entries/{key:.+}", admin.delete_entry, guard),
            ("POST", "/admin/purge", admin.purge, guard),
        ]
    allowed: dict[str, set[str]] = {}
    for method, path, handler, options in routes:
        app.router.add_route(method, path, edge(handler, endpoint=path, **options))
        allowed.setdefault(path, set()).add(method)
    app.router.add_route("*", "/{tail:.*}", edge(no_route(allowed)))


def _build_runner(settings: Settings) -> Runner:
    """In-process MLX, or the upstream mlx_lm.server pool when upstreams are given."""
    if settings.upstream:
        return UpstreamRunner(UpstreamOptions(
            urls=settings.upstream, model_dir=Path(settings.model_dir),
            model_id=settings.served_model_id, queue_size=settings.queue_size,
            default_max_tokens=settings.default_max_tokens,
            max_tokens_cap=settings.max_tokens_cap, device_scope=settings.device_scope,
            digest_memo=Path(settings.digest_memo), timeout=settings.upstream_timeout))
    return MlxRunner(MlxOptions(
        model=settings.model, model_id=settings.served_model_id,
        queue_size=settings.queue_size, default_max_tokens=settings.default_max_tokens,
        max_tokens_cap=settings.max_tokens_cap, device_scope=settings.device_scope,
        digest_memo=Path(settings.digest_memo)))


def _lifecycle(
    settings: Settings, runner: Runner | None, store: Backend | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        the_store = store or open_backend(settings.store)  # a bad URL fails before loading
        the_runner = runner or _build_runner(settings)
        proxy: CachingProxy | None = None
        invalidator: Invalidator | None = None
        try:
            if runner is None:
                await the_runner.start()
            invalidator = Invalidator(the_runner, the_store, policy=settings.invalidation,
                                      reload_wait=settings.reload_wait)
            await invalidator.start(
                watch_interval=settings.watch_interval if settings.watch else None)
            app[INVALIDATOR] = invalidator
            if isinstance(the_runner, UpstreamRunner):  # it sees engine changes by itself
                the_runner.on_fingerprint_change = invalidator.fingerprint_changed
            proxy = CachingProxy(the_runner, the_store,
                                 ServiceOptions(generation_timeout=settings.generation_timeout,
                                                ttl=settings.ttl,
                                                store_retry=settings.store_retry,
                                                lock_ttl=settings.lock_ttl),
                                 gate=invalidator.wait_ready, gate_open=invalidator.is_open)
            app[PROXY] = proxy
            log.info("serving", model=settings.served_model_id,
                     fingerprint=the_runner.fingerprint().digest,
                     store=redact_url(settings.store))
            yield
        finally:
            if invalidator is not None:
                await invalidator.aclose()
            if proxy is not None:
                await proxy.aclose()
            # Tear down only what this app started; injected parts belong to the caller.
            if store is None:
                await the_store.aclose()
            if runner is None:
                await the_runner.aclose()

    return ctx
