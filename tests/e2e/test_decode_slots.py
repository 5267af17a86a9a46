"""`--decode-slots S` in-process, with the demo model: concurrent misses decode together in
one pinned batch, each streams its own answer, and a repeat is a HIT."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from cacheproxy.cli.settings import DEMO_MODEL_ID
from cacheproxy.errors import ContextLengthExceeded, Overloaded
from cacheproxy.keys.canonical import CanonicalRequest, parse
from cacheproxy.keys.codec import Output
from cacheproxy.runners.base import Generation
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from policies.sampling import SamplingMode
from tests.conftest import ProxyFactory, eventually

SLOTS = 4
QUESTIONS = ("What does the fox eat?", "Where does the owl live?", "Tell me about the bear.",
             "What sound does the duck make?", "Is the horse big or small?",
             "What does the rabbit eat?")


@pytest_asyncio.fixture(scope="module")
async def slots_runner() -> AsyncIterator[MlxRunner]:
    r = MlxRunner(MlxOptions(model=str(BUNDLED_MODEL), model_id=DEMO_MODEL_ID,
                             decode_slots=SLOTS))
    await r.start()
    yield r
    await r.aclose()


async def _stream(session: aiohttp.ClientSession, url: str, question: str
                  ) -> tuple[str, list[str]]:
    body = {"model": DEMO_MODEL_ID, "messages": [{"role": "user", "content": question}],
            "max_tokens": 12, "stream": True}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        status = resp.headers["X-Cache"]
        pieces = []
        async for line in resp.content:
            text = line.decode().strip()
            if text.startswith("data: {"):
                delta = json.loads(text.removeprefix("data: "))["choices"][0]["delta"]
                pieces.append(delta.get("content") or delta.get("reasoning") or "")
    return status, pieces


async def test_concurrent_misses_decode_together_stream_and_repeat_as_hits(
        make_proxy: ProxyFactory, slots_runner: MlxRunner) -> None:
    proxy = await make_proxy(the_runner=slots_runner)
    async with aiohttp.ClientSession() as session:
        first = await asyncio.gather(*(_stream(session, proxy.url, q) for q in QUESTIONS))
        assert [status for status, _ in first] == ["MISS"] * len(QUESTIONS)
        assert all(len([p for p in pieces if p]) >= 2 for _, pieces in first)  # streamed
        again = await asyncio.gather(*(_stream(session, proxy.url, q) for q in QUESTIONS))
        assert [status for status, _ in again] == ["HIT"] * len(QUESTIONS)
        assert ["".join(p) for _, p in again] == ["".join(p) for _, p in first]
        async with session.get(proxy.url + "/health") as resp:
            lane: dict[str, Any] = (await resp.json())["lane"]
        async with session.get(proxy.url + "/metrics") as resp:
            metrics = await resp.text()
    assert lane["slots"] == SLOTS and lane["slots_in_use"] == 0 and lane["queued"] == 0
    assert lane["decode_tokens_per_s"] > 0 and 0 < lane["batch_occupancy"] <= 1
    assert f'cacheproxy_lane{{figure="slots"}} {float(SLOTS)}' in metrics
    assert 'cacheproxy_lane{figure="batch_occupancy"}' in metrics
    fingerprint = slots_runner.fingerprint()
    assert fingerprint.decode_slots == SLOTS


def _request(runner: MlxRunner, question: str, max_tokens: int) -> CanonicalRequest:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
    return parse(body, "chat", runner.defaults(), SamplingMode.FORCE_GREEDY).request


async def _output(generation: Generation) -> Output:
    async for _ in generation.chunks():
        pass
    assert generation.output is not None
    return generation.output


async def test_a_cancelled_generation_frees_its_slot_and_its_neighbours_go_on(
        slots_runner: MlxRunner) -> None:
    neighbour = slots_runner.generate(_request(slots_runner, QUESTIONS[0], 40))
    leaver = slots_runner.generate(_request(slots_runner, QUESTIONS[1], 200))
    async for _ in leaver.chunks():
        break  # its first chunk: it decodes beside the neighbour
    leaver.cancel()
    gone, kept = await asyncio.gather(_output(leaver), _output(neighbour))
    assert gone.finish_reason == "cancelled" and gone.completion_tokens < 200
    assert kept.finish_reason in ("length", "stop") and kept.completion_tokens > 0
    assert slots_runner.lane_state()["slots_in_use"] == 0


async def test_a_reload_waits_for_the_slots_to_drain(slots_runner: MlxRunner) -> None:
    """The generations decoding when a reload is asked finish on the model they began with,
    before it loads; the ones still waiting start after it (a batch never mixes models)."""
    generations = [slots_runner.generate(_request(slots_runner, q, 30)) for q in QUESTIONS]
    ended: dict[int, float] = {}

    async def read(i: int) -> Output:
        output = await _output(generations[i])
        ended[i] = time.monotonic()
        return output

    readers = [asyncio.create_task(read(i)) for i in range(len(QUESTIONS))]
    await eventually(lambda: slots_runner.lane_state()["slots_in_use"] == SLOTS)
    await slots_runner.reload()
    reloaded = time.monotonic()
    outputs = await asyncio.gather(*readers)
    assert all(ended[i] < reloaded for i in range(SLOTS))
    assert all(ended[i] > reloaded for i in range(SLOTS, len(QUESTIONS)))
    assert all(o.finish_reason in ("length", "stop") for o in outputs)


async def test_the_queue_bound_counts_waiting_and_decoding_generations_and_a_long_prompt_fails(
        ) -> None:
    runner = MlxRunner(MlxOptions(model=str(BUNDLED_MODEL), model_id=DEMO_MODEL_ID,
                                  decode_slots=2, queue_size=3))
    await runner.start()
    try:
        too_long = _request(runner, "fox " * runner.defaults().context_length, 4)
        with pytest.raises(ContextLengthExceeded):
            await _output(runner.generate(too_long))
        generations = [runner.generate(_request(runner, q, 8)) for q in QUESTIONS[:3]]
        with pytest.raises(Overloaded):
            runner.generate(_request(runner, QUESTIONS[3], 8))
        outputs = await asyncio.gather(*(_output(g) for g in generations))
        assert all(o.completion_tokens > 0 for o in outputs)
        assert runner.lane_state()["queued"] == 0
    finally:
        await runner.aclose()


async def test_each_load_has_its_prefill_process_and_a_dead_one_is_started_again(
        slots_runner: MlxRunner) -> None:
    """S > 1 prefills in a process of its own (`runners.prefiller`), one per loaded model: a
    reload starts another and ends the old one; one killed between two requests is started
    again by the next prefill, which answers as before."""
    question = _request(slots_runner, QUESTIONS[2], 12)
    before = await _output(slots_runner.generate(question))
    old = slots_runner._current().prefiller
    assert old is not None and old.pid is not None
    await slots_runner.reload()
    new = slots_runner._current().prefiller
    assert new is not None and new.pid is not None and new.pid != old.pid
    with pytest.raises(ProcessLookupError):
        os.kill(old.pid, 0)  # ended (and reaped) once the new model served
    killed = new.pid
    os.kill(killed, signal.SIGKILL)
    again = await _output(slots_runner.generate(question))
    assert again.chunks == before.chunks and again.finish_reason == before.finish_reason
    assert new.pid != killed
    assert slots_runner.lane_state()["prefill_restarts"] == 1  # (what operators see)


SYSTEM = ("You answer questions about animals of the forest, the river and the field: what "
          "they eat, where they live, how big they are and what sounds they make. Keep every "
          "answer short, plain and true, in one or two sentences, for a child of eight.")


def _long_request(runner: MlxRunner, question: str) -> CanonicalRequest:
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "max_tokens": 12, "logprobs": True, "top_logprobs": 3}
    return parse(body, "chat", runner.defaults(), SamplingMode.FORCE_GREEDY).request


async def test_prefills_on_a_thread_answer_as_prefills_in_the_process() -> None:
    """`--no-prefill-process`: the prefill on a thread beside the decode steps, no second
    process; the same computation, so the same answers, logprobs and saved prefix chunks
    (not in the fingerprint). A small step: prompts of several chunks, the later ones
    continued from the first one's saved chunks (the slot's code of both paths: the store's
    lookup, the restore, the chunks run, the chunks saved)."""
    runners = [MlxRunner(MlxOptions(model=str(BUNDLED_MODEL), model_id=DEMO_MODEL_ID,
                                    decode_slots=SLOTS, prefill_step=32, prefill_process=apart))
               for apart in (True, False)]
    for runner in runners:
        await runner.start()
    try:
        assert "prefill_restarts" not in runners[1].lane_state()  # (no process to restart)
        assert runners[0].fingerprint() == runners[1].fingerprint()
        outputs: list[list[Output]] = []
        for runner in runners:
            first = await _output(runner.generate(_long_request(runner, QUESTIONS[0])))
            rest = await asyncio.gather(*(_output(runner.generate(_long_request(runner, q)))
                                          for q in QUESTIONS[1:4]))
            outputs.append([first, *rest])
        apart, here = outputs
        assert apart == here
        assert all(o.chunks[0].logprobs for o in apart)  # (logprobs compared, to the bit)
        states = [r.lane_state() for r in runners]
        assert states[0]["prefix_entries"] == states[1]["prefix_entries"] >= 3
        assert states[0]["prefix_bytes"] == states[1]["prefix_bytes"]
    finally:
        for runner in runners:
            await runner.aclose()
