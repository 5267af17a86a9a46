"""The edge of every route: request id, OpenAI-shaped errors, one log line per request.

A wrapper per route rather than an aiohttp middleware: the same behaviour, without the
middleware chain's cost on the hit path. Unknown paths and methods reach `no_route`
through a catch-all route, so they get the same errors and log lines.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Awaitable, Callable
from functools import wraps

import structlog
from aiohttp import web

from cacheproxy.errors import (
    GenerationFailed,
    MethodNotAllowed,
    PayloadTooLarge,
    ProxyError,
    RouteNotFound,
)
from cacheproxy.state import CACHE_LOG, SETTINGS

log = structlog.get_logger("cacheproxy.access")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ID_PREFIX = os.urandom(6).hex()
_ids = itertools.count()


def _error_response(error: ProxyError) -> web.Response:
    from cacheproxy.handlers import json_response

    return json_response(error.body(), status=error.status, headers=error.headers())


def _as_proxy_error(exc: web.HTTPException, request: web.Request) -> ProxyError:
    if exc.status == 413:
        limit = request.app[SETTINGS].max_body_bytes
        return PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
    return GenerationFailed(f"{exc.status} {exc.reason}")


def edge(handler: Handler) -> Handler:
    """Wrap a route handler with the request id, error mapping and the access log line."""

    @wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        request_id = request.headers.get("X-Request-Id") or f"{_ID_PREFIX}{next(_ids):010x}"
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
        log.info("request", request_id=request_id, method=request.method, path=request.path,
                 status=response.status,
                 total_ms=round((time.monotonic() - started) * 1000, 2),
                 **request.get(CACHE_LOG, {}))
        return response

    return wrapped


def no_route(allowed: dict[str, set[str]]) -> Handler:
    """The catch-all: 405 for a known path with another method, 404 otherwise."""

    async def handler(request: web.Request) -> web.StreamResponse:
        methods = allowed.get(request.path)
        if methods:
            raise MethodNotAllowed(f"{request.method} is not allowed on {request.path}; "
                                   f"use {', '.join(sorted(methods))}")
        raise RouteNotFound(f"no endpoint {request.method} {request.path}")

    return handler
