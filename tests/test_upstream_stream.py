"""The streamed-completion reader of upstream mode, against scripted raw HTTP servers.

Each test runs on asyncio's loop and on uvloop (the one `cacheproxy serve` uses: its
transports are not asyncio.Transport subclasses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import orjson
import pytest
import uvloop

from cacheproxy.errors import ProxyError, UpstreamTimeout, UpstreamUnavailable
from cacheproxy.runners.upstream_stream import Unreachable, stream
from cacheproxy.runners.upstream_wire import Delta
from tests.conftest import free_port

Run = Callable[[Coroutine[Any, Any, Any]], Any]
HEAD = b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
FP = "0.32.2-0.32.4-Linux"


def event(text: str, finish: str | None = None, fingerprint: str = FP) -> bytes:
    """One SSE event as mlx_lm.server writes it."""
    return b"data: " + orjson.dumps({"system_fingerprint": fingerprint, "choices": [
        {"delta": {"content": text}, "finish_reason": finish}]}) + b"\n\n"


Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def serve(script: Script, seen: list[bytes] | None = None) -> tuple[str, asyncio.Server]:
    """A server that reads one request, then writes what `script` writes, then closes."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        if seen is not None:
            seen.append(head + await reader.readexactly(length))
        try:
            await script(writer)
            writer.close()
        except ConnectionError:
            pass

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    return f"http://127.0.0.1:{port}", server


def writes(*parts: bytes, pause: float = 0.0) -> Script:
    """A script that writes each part, draining (and pausing) between them."""
    async def script(writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)
    return script


async def read(url: str, take: Callable[[Delta], bool | None], limit: float = 5.0
               ) -> list[list[Delta]]:
    """Run a stream to its end; the deferred batches."""
    batches = []
    async for batch in stream(url, "/v1/chat/completions", b'{"x": 1}', limit=limit,
                              take=take):
        batches.append(batch)
    return batches


@pytest.fixture(params=[asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Run a coroutine on a fresh loop of either kind."""
    runner: Run = request.param
    return runner


def test_events_are_taken_where_they_arrive_until_done(run: Run) -> None:
    async def main() -> None:
        seen: list[bytes] = []
        url, server = await serve(writes(HEAD, event("Hel"), event("lo", "stop"),
                                         b"data: [DONE]\n\n", pause=0.01), seen)
        taken: list[str] = []
        async with server:
            assert await read(url, lambda d: taken.append(d.text) or False) == []
        assert taken == ["Hel", "lo"]
        assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.0\r\n")
        assert b"Connection: close\r\n" in seen[0] and seen[0].endswith(b'{"x": 1}')
    run(main())


def test_a_deferred_event_and_all_later_ones_go_to_the_task_in_order(run: Run) -> None:
    async def main() -> None:
        url, server = await serve(writes(HEAD, event("a"), event("b", fingerprint="new"),
                                         event("c"), b"data: [DONE]\n\n", pause=0.01))
        taken: list[str] = []

        def take(d: Delta) -> bool | None:
            if d.fingerprint != FP:
                return None
            taken.append(d.text)
            return False

        async with server:
            batches = await read(url, take)
        assert taken == ["a"]
        assert [d.text for batch in batches for d in batch] == ["b", "c"]
    run(main())


def test_take_stops_the_reading_and_hangs_up(run: Run) -> None:
    async def main() -> None:
        hung_up = asyncio.Event()

        async def endless(writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD)
            try:
                while True:
                    writer.write(event("x"))
                    await writer.drain()
                    await asyncio.sleep(0.01)
            except ConnectionError:
                hung_up.set()

        url, server = await serve(endless)
        taken: list[str] = []
        async with server:
            assert await read(url, lambda d: taken.append(d.text) or len(taken) == 3) == []
            await asyncio.wait_for(hung_up.wait(), 5)
        assert taken == ["x"] * 3
    run(main())


def test_a_stream_closed_before_done_is_an_error(run: Run) -> None:
    async def main() -> None:
        url, server = await serve(writes(HEAD, event("a")))
        async with server:
            with pytest.raises(UpstreamUnavailable, match=r"before \[DONE\]"):
                await read(url, lambda d: False)
    run(main())


def test_refusals_chunked_answers_refused_connections_and_silence(run: Run) -> None:
    async def main() -> None:
        refusal = b'{"error": "top_k must be at most 3"}'
        url, server = await serve(writes(
            b"HTTP/1.0 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(refusal), refusal))
        async with server:
            with pytest.raises(ProxyError) as info:  # a 4xx is passed through
                await read(url, lambda d: False)
        assert (info.value.status, info.value.message) == (
            400, "upstream: top_k must be at most 3")
        url, server = await serve(writes(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                                         b"\r\n"))
        async with server:
            with pytest.raises(UpstreamUnavailable, match="chunked"):
                await read(url, lambda d: False)
        with pytest.raises(Unreachable):
            await read(f"http://127.0.0.1:{free_port()}", lambda d: False)
        url, server = await serve(writes(HEAD, event("a"), pause=2.0))
        async with server:
            with pytest.raises(UpstreamTimeout, match="went silent"):
                await read(url, lambda d: False, limit=0.3)
    run(main())
