"""create_app(settings): routes, middlewares, and the lifecycle of runner, store and fills."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import structlog
from aiohttp import web

from backends import open_backend
from backends.base import Backend
from cacheproxy import handlers
from cacheproxy.errors import (
    GenerationFailed,
    MethodNotAllowed,
    PayloadTooLarge,
    ProxyError,
    RouteNotFound,
)
from cacheproxy.invalidation import Invalidator
from cacheproxy.runners.base import Runner
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from cacheproxy.service import CachingProxy, ServiceOptions
from cacheproxy.settings import Settings
from cacheproxy.state import CACHE_LOG, INVALIDATOR, PROXY, SETTINGS, STARTED

log = structlog.get_logger("cacheproxy.access")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _as_proxy_error(exc: web.HTTPException, request: web.Request) -> ProxyError:
    if exc.status == 413:
        limit = request.app[SETTINGS].max_body_bytes
        return PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
    if exc.status == 405:
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
    return RouteNotFound(f"no endpoint {request.method} {request.path}")


def _error_response(error: ProxyError) -> web.Response:
    return handlers.json_response(error.body(), status=error.status, headers=error.headers())


@web.middleware
async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, OpenAI-shaped errors for everything, one log line per request."""
    started = time.monotonic()
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    try:
        response = await handler(request)
    except ProxyError as exc:
        response = _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error_response(_as_proxy_error(exc, request))
    except Exception:
        log.exception("unhandled_error", request_id=request_id, path=request.path)
        response = _error_response(GenerationFailed("internal error"))
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
    cache = request.get(CACHE_LOG, {})
    log.info("request", request_id=request_id, method=request.method, path=request.path,
             status=response.status, total_ms=round((time.monotonic() - started) * 1000, 2),
             **cache)
    return response


def create_app(
    settings: Settings, *, runner: Runner | None = None, store: Backend | None = None
) -> web.Application:
    """The aiohttp application; a given (already started) runner or store is used as is."""
    app = web.Application(middlewares=[edge], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[STARTED] = time.time()
    app.cleanup_ctx.append(_lifecycle(settings, runner, store))
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    return app


def _lifecycle(
    settings: Settings, runner: Runner | None, store: Backend | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        the_store = store or open_backend(settings.store)  # a bad URL fails before loading
        the_runner = runner or MlxRunner(MlxOptions(
            model=settings.model, model_id=settings.served_model_id,
            queue_size=settings.queue_size, default_max_tokens=settings.default_max_tokens,
            max_tokens_cap=settings.max_tokens_cap, device_scope=settings.device_scope,
            digest_memo=Path(settings.digest_memo)))
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
            proxy = CachingProxy(the_runner, the_store,
                                 ServiceOptions(generation_timeout=settings.generation_timeout),
                                 gate=invalidator.wait_ready)
            app[PROXY] = proxy
            log.info("serving", model=settings.served_model_id,
                     fingerprint=the_runner.fingerprint().digest, store=settings.store)
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
