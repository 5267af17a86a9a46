"""A bound on open client connections: past it, a connection gets a 503 and is closed."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from cacheproxy.errors import Overloaded

_BODY = orjson.dumps(Overloaded("too many open connections, retry later").body())
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
    + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


def limit_connections(server: web.Server, max_connections: int) -> None:
    """Refuse connections past `max_connections`, before any of their requests is read."""
    admit = server.connection_made

    def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
        admit(handler, transport)
        if len(server.connections) > max_connections:
            transport.write(REFUSAL)
            transport.close()

    # aiohttp's Server has no hook for this; its handlers call server.connection_made.
    server.connection_made = connection_made  # type: ignore[method-assign]
