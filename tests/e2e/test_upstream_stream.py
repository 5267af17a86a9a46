"""The streamed-completion reader of upstream mode, against scripted raw HTTP servers.

Each test runs on asyncio's loop and on uvloop (the one `cacheproxy serve` uses: its
transports are not asyncio.Transport subclasses).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import orjson
import pytest
import uvloop

from cacheproxy.errors import ProxyError, UpstreamTimeout, UpstreamUnavailable
from cacheproxy.runners.live import Live
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


def endless(hung_up: asyncio.Event) -> Script:
    """A script that writes an event every 10 ms until the reader hangs up (then sets
    `hung_up`)."""
    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        try:
            while True:
                writer.write(event("x"))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            hung_up.set()
    return script


async def read(url: str, take: Callable[[Delta], bool | None], limit: float = 5.0,
               live: Live | None = None) -> list[list[Delta]]:
    """Run a stream to its end; the deferred batches."""
    batches = []
    async for batch in stream(url, "/v1/chat/completions", b'{"x": 1}', limit=limit,
                              take=take, live=live):
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
        url, server = await serve(endless(hung_up))
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


# Gathering: while nobody reads live, the kernel holds the events (SO_RCVLOWAT, Linux only).
linux = pytest.mark.skipif(sys.platform != "linux", reason="gathering is Linux-only")
TOKENS = [event(f"w{i} ") for i in range(20)]
DONE = b"data: [DONE]\n\n"


def paced(*steps: bytes | float) -> Script:
    """A script that writes each bytes step and sleeps each float step."""
    async def script(writer: asyncio.StreamWriter) -> None:
        for step in steps:
            if isinstance(step, float):
                await asyncio.sleep(step)
            else:
                writer.write(step)
                await writer.drain()
    return script


def every(pause: float, parts: list[bytes]) -> list[bytes | float]:
    """Each part, then a pause."""
    return [step for part in parts for step in (part, pause)]


def timed(times: list[float], verdict: Callable[[], bool] = lambda: False
          ) -> Callable[[Delta], bool]:
    """A take that notes when each event was taken."""
    loop = asyncio.get_running_loop()
    return lambda d: times.append(loop.time()) or verdict()


def bursts(times: list[float]) -> list[int]:
    """How many events arrived together (less than 0.5 ms apart)."""
    sizes = [1]
    for before, now in zip(times, times[1:], strict=False):
        if now - before < 0.0005:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


class Passes:
    """Counts the event loop's passes (a task that yields at every one), to tell which events
    one read handed over: those taken in the same pass. Wall-clock gaps could not: a stall of
    the test process in the middle of handing over one read's events split it in two."""

    def __init__(self) -> None:
        self.now = 0
        self.taken: list[int] = []
        self._task = asyncio.get_running_loop().create_task(self._count())

    async def _count(self) -> None:
        while True:
            self.now += 1
            await asyncio.sleep(0)

    def take(self, verdict: Callable[[], bool] = lambda: False) -> Callable[[Delta], bool]:
        """A take that notes in which pass each event was taken."""
        return lambda d: self.taken.append(self.now) or verdict()

    def reads(self) -> list[int]:
        """How many events each read handed over (stops counting)."""
        self._task.cancel()
        return [len(list(group)) for _, group in itertools.groupby(self.taken)]


@linux
def test_without_a_live_reader_the_events_after_the_first_are_taken_at_the_close(
        run: Run) -> None:
    async def main() -> None:
        script = paced(HEAD, TOKENS[0], 0.1, *every(0.01, TOKENS[1:]), DONE)
        gathered = Passes()
        url, server = await serve(script)
        async with server:  # the first shows the engine, the kernel holds the rest
            assert await read(url, gathered.take(), live=Live()) == []
        assert gathered.reads() == [1, 19]
        one_by_one = Passes()
        url, server = await serve(script)
        live = Live()
        live.start()
        async with server:  # a live reader: each event as it comes
            assert await read(url, one_by_one.take(), live=live) == []
        assert len(one_by_one.reads()) >= 10, one_by_one.taken
    run(main())


@linux
def test_a_reader_going_live_gets_what_was_held_then_each_event_as_it_comes(run: Run) -> None:
    async def main() -> None:
        url, server = await serve(paced(HEAD, TOKENS[0], 0.1, *every(0.03, TOKENS[1:]), DONE))
        passes = Passes()
        live = Live()
        async with server:
            asyncio.get_running_loop().call_later(0.3, live.start)  # about 7 written by then
            assert await read(url, passes.take(), live=live) == []
        sizes = passes.reads()
        assert sizes[0] == 1 and sizes[1] >= 3 and len(sizes) >= 8, (sizes, passes.taken)
    run(main())


@linux
def test_a_gathering_reader_told_to_stop_going_live_stops_and_hangs_up(run: Run) -> None:
    # A cancelled generation starts Live (Generation.cancel) so that `take` sees it.
    async def main() -> None:
        hung_up = asyncio.Event()
        url, server = await serve(endless(hung_up))
        live, stop, passes = Live(), asyncio.Event(), Passes()
        asyncio.get_running_loop().call_later(0.2, lambda: (stop.set(), live.start()))
        async with server:  # 64 KiB of these take 6 s to gather: it goes live at once
            await asyncio.wait_for(read(url, passes.take(stop.is_set), live=live), 3)
            await asyncio.wait_for(hung_up.wait(), 3)
        # The first event, then the first of those held, which saw the stop (read one by
        # one, some twenty would have been taken before it).
        assert passes.reads() == [1, 1], passes.taken
    run(main())


@linux
def test_silence_while_gathering_is_told_from_the_bytes_waiting(run: Run) -> None:
    async def main() -> None:
        # An event every 0.03 s for 0.6 s, limit 0.4 s: not silent, though unread (its
        # looks, every 0.1 s, see bytes arriving; a look that saw none would take them).
        url, server = await serve(paced(HEAD, *every(0.03, TOKENS), DONE))
        passes = Passes()
        async with server:
            assert await read(url, passes.take(), limit=0.4, live=Live()) == []
        assert len(passes.taken) == len(TOKENS) and len(passes.reads()) <= 3, passes.taken
        url, server = await serve(paced(HEAD, TOKENS[0], 2.0))
        async with server:
            with pytest.raises(UpstreamTimeout, match="went silent"):
                await read(url, lambda d: False, limit=0.3, live=Live())
    run(main())


@linux
def test_events_held_by_an_upstream_slow_to_close_are_taken_at_a_look(run: Run) -> None:
    async def main() -> None:
        # [DONE], then the connection stays open for 3 s: the held bytes are read anyway.
        url, server = await serve(paced(HEAD, *every(0.01, TOKENS), DONE, 3.0))
        taken: list[float] = []
        loop = asyncio.get_running_loop()
        async with server:
            started = loop.time()
            assert await read(url, timed(taken), limit=0.4, live=Live()) == []
            assert loop.time() - started < 1.5 and len(taken) == len(TOKENS)
    run(main())


@linux
def test_an_event_of_another_engine_is_not_gathered(run: Run) -> None:
    async def main() -> None:
        # The first event must pass `take` (the expected engine) before anything is held.
        url, server = await serve(paced(HEAD, 0.05, event("a", fingerprint="new"), 0.3,
                                        *every(0.01, TOKENS), DONE))
        loop = asyncio.get_running_loop()
        async with server:
            started = loop.time()
            async for batch in stream(url, "/v1/chat/completions", b"{}", limit=5.0,
                                      take=lambda d: None if d.fingerprint == "new" else False,
                                      live=Live()):
                assert batch[0].text == "a" and loop.time() - started < 0.3
                break
    run(main())
