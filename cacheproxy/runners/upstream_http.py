"""HTTP to mlx_lm.server: streamed and whole completions, health, the engine's fingerprint.

mlx_lm.server speaks HTTP/1.0: one connection per request, a stream ends with
`data: [DONE]` and then the connection closes. A stream that closes without [DONE] was
broken off (say the upstream died), and is an error: nothing partial may be stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from cacheproxy.errors import ProxyError, UpstreamTimeout, UpstreamUnavailable
from cacheproxy.runners.upstream_wire import DONE, Delta, delta, parse_line, probe_body, rejection

_JSON = {"Content-Type": "application/json"}


class Unreachable(UpstreamUnavailable):
    """The connection failed: nothing was sent, another member may take the request."""


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


class _Silence:
    """Closes a response that stays silent for `limit` seconds (detected within 1.25 x).

    It looks four times per limit instead of re-arming a timer per chunk, as aiohttp's
    sock_read does: that re-arming was a third of the relay's CPU per token.
    """

    def __init__(self, response: aiohttp.ClientResponse, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._response, self._limit = response, limit
        self.heard = self._loop.time()
        self.expired = False
        self._handle = self._loop.call_later(limit / 4, self._check)

    def _check(self) -> None:
        if self._loop.time() - self.heard < self._limit:
            self._handle = self._loop.call_later(self._limit / 4, self._check)
            return
        self.expired = True
        self._response.close()

    def hear(self) -> None:
        """Bytes arrived."""
        self.heard = self._loop.time()

    def cancel(self) -> None:
        """Stop watching."""
        self._handle.cancel()


async def _lines(content: aiohttp.StreamReader, silence: _Silence) -> AsyncIterator[bytes]:
    # Split by hand: StreamReader.readline refuses lines over its buffer limit.
    buffer = b""
    async for data in content.iter_any():
        silence.hear()
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line
    if buffer:
        yield buffer


class UpstreamClient:
    """HTTP to mlx_lm.server: HTTP/1.0, one connection per request, so none is pooled."""

    def __init__(self, *, timeout: float) -> None:
        # No sock_read: a stream's silence is watched by _Silence, the headers by a timeout.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=timeout),
        )
        self._timeout = timeout
        self._probe_timeout = aiohttp.ClientTimeout(total=timeout)

    async def stream(self, url: str, path: str, body: bytes) -> AsyncGenerator[Delta, None]:
        """The events of a streamed completion; raises unless the stream ends in [DONE]."""
        async with _translated(url):
            async with asyncio.timeout(self._timeout):
                response = await self._session.post(url + path, data=body, headers=_JSON)
            silence = _Silence(response, self._timeout)
            try:
                if response.status != 200:
                    raise rejection(response.status, await response.read())
                async for line in _lines(response.content, silence):
                    item = parse_line(line)
                    if item is DONE:
                        return
                    if isinstance(item, dict):
                        yield delta(item)
            except aiohttp.ClientError:
                if not silence.expired:
                    raise
            finally:
                silence.cancel()
                response.close()
            if silence.expired:
                raise UpstreamTimeout(f"the upstream {url} went silent for {self._timeout:g} s")
        raise UpstreamUnavailable(f"the upstream {url} closed the stream before [DONE]")

    async def complete(self, url: str, path: str, body: bytes) -> dict[str, Any]:
        """A whole (non-streamed) completion."""
        async with _translated(url), self._session.post(
            url + path, data=body, headers=_JSON, timeout=self._probe_timeout
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
                    async with self._session.get(url + path,
                                                 timeout=self._probe_timeout) as response:
                        if response.status != 404:
                            return response.status == 200
        except ProxyError:
            return False
        return False

    async def served_models(self, url: str) -> list[str]:
        """The model ids /v1/models lists; [] when its body is empty or not a list."""
        try:
            async with _translated(url), self._session.get(
                url + "/v1/models", timeout=self._probe_timeout
            ) as response:
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
