"""HTTP to mlx_lm.server: streamed and whole completions, health, the engine's fingerprint.

mlx_lm.server speaks HTTP/1.0: one connection per request, a stream ends with
`data: [DONE]` and then the connection closes. A stream that closes without [DONE] was
broken off (say the upstream died), and is an error: nothing partial may be stored.
Streams, the hot path of a miss, are read by `upstream_stream`; the rest goes through aiohttp.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from cacheproxy.errors import ProxyError, UpstreamTimeout, UpstreamUnavailable
from cacheproxy.runners import upstream_stream
from cacheproxy.runners.live import Live
from cacheproxy.runners.upstream_stream import Unreachable
from cacheproxy.runners.upstream_wire import Delta, probe_body, rejection

_JSON = {"Content-Type": "application/json"}


@asynccontextmanager
async def _translated(url: str) -> AsyncIterator[None]:
    """aiohttp's exceptions as the proxy's: unreachable, timed out, broken off."""
    try:
        yield
    except ProxyError:
        raise
    except aiohttp.ClientConnectorError as exc:
        raise Unreachable(f"cannot connect to the upstream {url}: {exc.os_error}") from None
    except TimeoutError:
        raise UpstreamTimeout(f"the upstream {url} did not answer in time") from None
    except aiohttp.ClientError as exc:
        raise UpstreamUnavailable(f"the upstream {url} broke off: {exc!r}") from None


class UpstreamClient:
    """HTTP to mlx_lm.server: HTTP/1.0, one connection per request, so none is pooled."""

    def __init__(self, *, timeout: float) -> None:
        # Probes, health checks and whole replies; streamed completions go through
        # `upstream_stream`, which needs no session.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
            timeout=aiohttp.ClientTimeout(total=timeout),
        )
        self._timeout = timeout

    def stream(self, url: str, path: str, body: bytes, take: upstream_stream.Take,
               live: Live | None = None) -> AsyncGenerator[list[Delta], None]:
        """A streamed completion: events to `take` as they arrive, the deferred ones yielded,
        gathered until `live` starts if given (see `upstream_stream`); raises unless the
        stream ends in [DONE] or `take` stops it."""
        return upstream_stream.stream(url, path, body, limit=self._timeout, take=take,
                                      live=live)

    async def complete(self, url: str, path: str, body: bytes) -> dict[str, Any]:
        """A whole (non-streamed) completion."""
        async with _translated(url), self._session.post(
            url + path, data=body, headers=_JSON
        ) as response:
            data = await response.read()
            if response.status != 200:
                raise rejection(response.status, data)
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise UpstreamUnavailable(f"the upstream {url} sent a body that is not JSON")
        return parsed

    async def system_fingerprint(self, url: str) -> str:
        """Read the engine's fingerprint: /v1/models does not carry it, a one-token reply does."""
        raw = (await self.complete(url, "/v1/completions", probe_body())).get(
            "system_fingerprint")
        if not isinstance(raw, str) or not raw:
            raise UpstreamUnavailable(f"the upstream {url} sent no system_fingerprint")
        return raw

    async def healthy(self, url: str) -> bool:
        """GET /health (GET /v1/models on servers without it: its body may be empty)."""
        try:
            async with _translated(url):
                for path in ("/health", "/v1/models"):
                    async with self._session.get(url + path) as response:
                        if response.status != 404:
                            return response.status == 200
        except ProxyError:
            return False
        return False

    async def served_models(self, url: str) -> list[str]:
        """The model ids /v1/models lists; [] when its body is empty or not a list."""
        try:
            async with _translated(url), self._session.get(url + "/v1/models") as response:
                data = await response.read()
            listed = orjson.loads(data).get("data") if data.strip() else None
        except (ProxyError, orjson.JSONDecodeError, AttributeError):
            return []
        if not isinstance(listed, list):
            return []
        return [str(m.get("id")) for m in listed if isinstance(m, dict)]

    async def aclose(self) -> None:
        """Close the session."""
        await self._session.close()
