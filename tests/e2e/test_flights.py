"""Flight readers: live followers see every chunk in order; whole-answer readers get the
output (or the error) at the end."""

from __future__ import annotations

import asyncio

import pytest

from cacheproxy.errors import GenerationTimeout
from cacheproxy.keys.codec import Chunk, Output
from cacheproxy.runners.base import Failed, Finished, Generation
from cacheproxy.runners.live import Live
from cacheproxy.service.flights import Flight

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



async def test_a_generation_relays_chunks_in_order_where_they_arrive() -> None:
    generation = Generation()
    early = [Chunk("a", (1,)), Chunk("b", (2,))]
    for chunk in early:  # arrived before anyone relays: queued
        generation.put(chunk)
    got: list[Chunk] = []
    woken = 0

    def publish(chunk: Chunk) -> None:
        got.append(chunk)

    async def produce() -> None:
        nonlocal woken
        await asyncio.sleep(0)  # the relay drains the queue first
        generation.put(Chunk("c", (3,)))  # nothing queued: handed on at once, no wake
        woken += generation._waiter is not None and generation._waiter.done()
        generation.put(Chunk("d", (4,)))
        generation.put(Finished(Output(tuple(early), "stop", 3, 4)))

    producer = asyncio.create_task(produce())
    output = await generation.relay(publish)
    await producer
    assert [c.text for c in got] == ["a", "b", "c", "d"]
    assert woken == 0 and output.finish_reason == "stop" and generation.output is output
    generation.put(Chunk("late", ()))  # after the end: queued, not published
    assert len(got) == 4


async def test_a_relayed_generation_raises_the_runner_error() -> None:
    generation = Generation()
    got: list[Chunk] = []

    async def produce() -> None:
        await asyncio.sleep(0)
        generation.put(Chunk("a", ()))
        generation.put(Failed(GenerationTimeout("too slow")))

    producer = asyncio.create_task(produce())
    with pytest.raises(GenerationTimeout):
        await generation.relay(got.append)
    await producer
    assert [c.text for c in got] == ["a"]


async def test_live_tells_each_listener_once_and_late_listeners_at_once() -> None:
    live, calls = Live(), []
    live.when(lambda: calls.append("early"))
    assert calls == [] and not live.on
    live.start()
    live.start()
    live.when(lambda: calls.append("late"))
    assert live.on and calls == ["early", "late"]


async def test_a_flight_followed_and_a_cancelled_generation_read_live() -> None:
    flight, generation = Flight("k"), Generation()
    flight.live.when(generation.live.start)  # as the service wires a fill
    whole = asyncio.create_task(flight.ended())
    await asyncio.sleep(0)
    assert not generation.live.on  # a whole-answer reader lets the runner gather
    following = flight.follow()
    flight.publish(CHUNKS[0])
    assert await anext(following) == CHUNKS[0] and generation.live.on
    await following.aclose()
    flight.finish(OUTPUT)
    await whole
    cancelled = Generation()
    cancelled.cancel()  # so that a gathering producer sees the next token
    assert cancelled.live.on
