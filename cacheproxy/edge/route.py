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
from typing import Any

import orjson
import structlog
from aiohttp import web
from multidict import istr

from backends.base import BackendError
from cacheproxy.edge.aiohttp_adapter import Rendered
from cacheproxy.edge.state import CACHE_LOG, OPTIONS
from cacheproxy.errors import (
    GenerationFailed,
    MethodNotAllowed,
    Overloaded,
    PayloadTooLarge,
    ProxyError,
    RouteNotFound,
    StoreDown,
)
from cacheproxy.observe.logs import access_writer
from cacheproxy.observe.metrics import FinishedRequest

log = structlog.get_logger("cacheproxy.access")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Guard = Callable[[web.Request], object]
Record = Callable[[FinishedRequest], None]

X_REQUEST_ID = istr("X-Request-Id")
MAX_REQUEST_ID = 128  # a client's own id, printable and at most this long, else one of ours
_ID_PREFIX = os.urandom(6).hex()
_ids = itertools.count()


JSON = "application/json"


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    """A JSON response serialized with orjson."""
    return web.Response(body=orjson.dumps(data), status=status, headers=headers,
                        content_type=JSON)


Shape = Callable[[ProxyError], dict[str, object]]
"""An API's error body (OpenAI's `error.body()` unless the route says otherwise)."""


def error_response(error: ProxyError, shape: Shape | None = None) -> web.Response:
    """The error's response in its route's API's shape."""
    body = error.body() if shape is None else shape(error)
    return json_response(body, status=error.status, headers=error.headers())


def _as_proxy_error(exc: web.HTTPException, request: web.Request) -> ProxyError:
    if exc.status == 413:
        limit = request.app[OPTIONS].max_body_bytes
        return PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
    return GenerationFailed(f"{exc.status} {exc.reason}")


class Limits:
    """Requests in flight on the API routes, against the configured bound."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0


def edge(handler: Handler, *, guard: Guard | None = None, endpoint: str = "",
         limits: Limits | None = None, record: Record | None = None,
         shape: Shape | None = None) -> Handler:
    """Wrap a route handler: request id, guard (auth), in-flight bound, error mapping (in
    the route's API's `shape`), then one access log line and the metrics of the finished
    request."""

    access = access_writer(log.bind())  # a concrete logger once configured: no lazy proxy
    fixed_path = endpoint if "{" not in endpoint else ""  # a templated route logs its path

    @wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        request_id = request.headers.get(X_REQUEST_ID, "")
        if not 0 < len(request_id) <= MAX_REQUEST_ID or not request_id.isprintable():
            request_id = f"{_ID_PREFIX}{next(_ids):010x}"
        counted = False
        try:
            if guard is not None:
                guard(request)
            if limits is not None:
                if limits.in_flight >= limits.max_in_flight:
                    raise Overloaded(f"more than {limits.max_in_flight} requests in flight")
                limits.in_flight += 1
                counted = True
            response = await handler(request)
        except ProxyError as exc:
            response = error_response(exc, shape)
            if exc.closes:
                response.force_close()
                if not request.content.is_eof():  # unread: closed at once, not lingered on
                    request.content.feed_eof()
            if exc.cache_log is not None:
                request[CACHE_LOG] = exc.cache_log
        except BackendError as exc:  # a store call outside the cache path (admin API)
            response = error_response(StoreDown(f"the store failed: {exc}"), shape)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = error_response(_as_proxy_error(exc, request), shape)
        except Exception:
            log.exception("unhandled_error", request_id=request_id, path=request.path)
            response = error_response(GenerationFailed("internal error"), shape)
        finally:
            if counted and limits is not None:
                limits.in_flight -= 1
        if type(response) is Rendered:
            response.request_id = request_id
            info = response.cache_log or request.get(CACHE_LOG, {})
        else:
            if not response.prepared:
                response.headers[X_REQUEST_ID] = request_id
            info = request.get(CACHE_LOG, {})
        seconds = time.monotonic() - started
        status = response.status
        total_ms = int(seconds * 100_000 + 0.5) / 100  # round(x, 2) costs four times this
        access(request_id, request.method, fixed_path or request.path, status, total_ms, info)
        if record is not None:
            record((endpoint or request.path, status, seconds, info))
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
