"""Flight readers: live followers see every chunk in order; whole-answer readers get the
output (or the error) at the end."""

from __future__ import annotations

import asyncio

import pytest

from cacheproxy.codec import Chunk, Output
from cacheproxy.errors import GenerationTimeout
from cacheproxy.flights import Flight

CHUNKS = tuple(Chunk(text=f"w{i} ", tokens=(i,)) for i in range(20))
OUTPUT = Output(chunks=CHUNKS, finish_reason="length", prompt_tokens=3, completion_tokens=20)


async def _feed(flight: Flight, error: GenerationTimeout | None = None) -> None:
    for chunk in CHUNKS:
        flight.publish(chunk)
        await asyncio.sleep(0)
    if error is None:
        flight.finish(OUTPUT)
    else:
        flight.fail(error)


async def test_whole_and_live_readers_of_one_flight() -> None:
    flight = Flight("k")

    async def live() -> list[Chunk]:
        return [chunk async for chunk in flight.follow()]

    readers = asyncio.gather(flight.ended(), live())
    await _feed(flight)
    whole, chunks = await readers
    assert whole is OUTPUT and tuple(chunks) == CHUNKS
    assert await flight.ended() is OUTPUT  # after the end too


async def test_a_failed_flight_raises_for_every_reader() -> None:
    flight = Flight("k")
    error = GenerationTimeout("too slow")

    async def live() -> int:
        seen = 0
        async for _ in flight.follow():
            seen += 1
        return seen

    whole, following = asyncio.create_task(flight.ended()), asyncio.create_task(live())
    await _feed(flight, error)
    with pytest.raises(GenerationTimeout):
        await whole
    with pytest.raises(GenerationTimeout):
        await following

