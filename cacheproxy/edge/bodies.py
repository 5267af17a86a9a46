"""Request bodies that do not arrive at once: bounded in time, in rate and in number.

A body that arrived with its headers (a small POST, the usual case) is taken as is by the
handler and never comes here. One still arriving is read here, and closed with a 408:
- past `timeout` seconds for the whole body;
- below `min_rate` bytes a second, counted from the start once GRACE seconds have passed
  (a body a byte every 3 s is cut after a second or two, not after the whole timeout);
- when `max_reading` bodies are already arriving and another starts: the oldest is cut. So
  clients that trickle bodies hold at most that many connections being read; and the
  connection guard (aiohttp_adapter.ConnectionGuard) cuts the body arriving longest
  to make room for a new connection, before it touches an idle keep-alive client. A cut
  body raises RequestTimeout out of its read (set on its stream).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from cacheproxy.errors import RequestTimeout

GRACE = 1.0  # seconds before the rate floor applies (a connection's first round trips)
TICK = 0.5  # seconds between two looks at a body's rate while it waits


@dataclass(frozen=True, slots=True, kw_only=True)
class BodyLimits:
    """How long, how slowly and how many bodies may arrive."""

    timeout: float = 10.0  # seconds for a whole body
    min_rate: float = 1024.0  # bytes a second, after GRACE (0: no floor)
    max_reading: int = 64  # bodies arriving at once (the oldest is cut past it)


class BodyReads:
    """The bodies arriving now, by connection, oldest first."""

    def __init__(self, limits: BodyLimits) -> None:
        self.limits = limits
        self._reading: OrderedDict[RequestHandler, web.Request] = OrderedDict()
        self.cut = 0  # bodies cut to make room for another

    def __len__(self) -> int:
        return len(self._reading)

    async def read(self, request: web.Request) -> bytes:
        """The whole body of `request`, within the limits (RequestTimeout, a 408 that
        closes the connection, otherwise; 413 past the app's client_max_size)."""
        if len(self._reading) >= self.limits.max_reading:
            self._cut_oldest(f"more than {self.limits.max_reading} request bodies were "
                             "arriving at once; this one had been arriving longest")
        handler = request.protocol
        self._reading[handler] = request
        try:
            return await self._read(request)
        finally:
            self._reading.pop(handler, None)

    def longest(self, among: Collection[RequestHandler]) -> StreamReader | None:
        """Of the bodies being read here for the connections `among`, the one that began
        arriving first (not cut yet); None when none of them is being read here."""
        for handler, request in self._reading.items():  # (in the order their reads began)
            body = request.content
            if handler in among and not body.is_eof() and body.exception() is None:
                return body
        return None

    def _cut_oldest(self, why: str) -> None:
        """Cut the body that started arriving first (its read ends in a 408 that closes
        its connection)."""
        _, request = self._reading.popitem(last=False)
        request.content.set_exception(RequestTimeout(f"the request body was cut: {why}"))
        self.cut += 1

    async def _read(self, request: web.Request) -> bytes:
        loop = asyncio.get_running_loop()
        limits, content, limit = self.limits, request.content, request.client_max_size
        started = loop.time()
        parts: list[bytes] = []
        got = 0
        while True:
            elapsed = loop.time() - started
            if elapsed >= limits.timeout:
                raise RequestTimeout(f"the request body did not arrive within "
                                     f"{limits.timeout:g} s")
            if limits.min_rate and got < limits.min_rate * (elapsed - GRACE):
                raise RequestTimeout(f"the request body arrived slower than "
                                     f"{limits.min_rate:g} bytes/s")
            try:
                async with asyncio.timeout(min(TICK, limits.timeout - elapsed)):
                    chunk = await content.readany()
            except TimeoutError:
                continue
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            got += len(chunk)
            if limit and got > limit:  # (0: no limit)
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=got)
