"""Single-flight: one fill per key, followers receive its chunks live as they are generated.

A fill runs as a task owned by `Flights`, never by a request: a client that goes away
only stops its own reading, the fill completes and is stored. `aclose` cancels fills
still running at shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from cacheproxy.codec import Chunk, Output
from cacheproxy.errors import GenerationFailed, ProxyError


class Flight:
    """One fill in progress: the chunks so far, a wake-up for more, and its outcome."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.chunks: list[Chunk] = []
        self.output: Output | None = None
        self.error: ProxyError | None = None
        self.from_store = False
        self.followers = 0
        self.generation_ms: float | None = None
        self.revalidated: str | None = None  # "match" | "mismatch" after a no-cache refill
        self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        """True once the fill finished or failed."""
        return self.output is not None or self.error is not None

    def publish(self, chunk: Chunk) -> None:
        """A new chunk for every reader."""
        self.chunks.append(chunk)
        self._wake()

    def finish(self, output: Output, *, from_store: bool = False) -> None:
        """The fill completed."""
        self.output, self.from_store = output, from_store
        self._wake()

    def fail(self, error: ProxyError) -> None:
        """The fill failed; every reader gets this error."""
        self.error = error
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def started(self) -> None:
        """Wait until the first chunk or the end, whichever comes first."""
        while not self.chunks and not self.done:
            await self._changed.wait()
        if self.error is not None and not self.chunks:
            raise self.error

    async def follow(self) -> AsyncIterator[Chunk]:
        """Every chunk from the first, then live ones, until the fill ends."""
        index = 0
        while True:
            while index < len(self.chunks):
                yield self.chunks[index]
                index += 1
            if self.error is not None:
                raise self.error
            if self.output is not None:
                return
            await self._changed.wait()


Fill = Callable[[Flight], Awaitable[None]]


class Flights:
    """The fills in progress, by key, and the tasks that run them."""

    def __init__(self) -> None:
        self._by_key: dict[str, Flight] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._by_key)

    def running(self, key: str) -> bool:
        """Whether a shared fill for `key` is in progress."""
        return key in self._by_key

    def join(self, key: str, fill: Fill, *, shared: bool = True) -> tuple[Flight, bool]:
        """The flight for `key` and whether the caller leads it (started the fill)."""
        if shared and (flight := self._by_key.get(key)) is not None:
            flight.followers += 1
            return flight, False
        flight = Flight(key)
        if shared:
            self._by_key[key] = flight
        task = asyncio.create_task(self._run(flight, fill, shared))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return flight, True

    async def _run(self, flight: Flight, fill: Fill, shared: bool) -> None:
        try:
            await fill(flight)
        except asyncio.CancelledError:
            flight.fail(GenerationFailed("the server is shutting down"))
            raise
        except ProxyError as exc:
            flight.fail(exc)
        except Exception as exc:  # a bug in a fill must still release its readers
            flight.fail(GenerationFailed(f"fill failed: {type(exc).__name__}: {exc}"))
        finally:
            if not flight.done:
                flight.fail(GenerationFailed("fill ended without a result"))
            if shared and self._by_key.get(flight.key) is flight:
                del self._by_key[flight.key]

    async def aclose(self) -> None:
        """Cancel every fill still running (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
