"""The lane of `--decode-slots S`: continuous batching at a pinned shape, on two threads
that share the model.

The lane thread, one turn of its loop:
1. run a lane call (a load, a reload) if one waits and no slot is in use; while one waits,
   nothing new is admitted, so the slots drain and a batch never mixes two models;
2. admit waiting generations into free slots (the runner plans each: prompt, checks) and
   hand them to the prefill thread;
3. settle the slots the prefill thread is done with: a failed prefill fails its generation,
   one with nothing to make (cancelled meanwhile, no tokens asked) ends, the others join the
   decode batch;
4. one decode step of every slot that joined: one forward of S rows (free rows hold a fixed
   dummy token), attention per row (`rows`), each row sampled by its own slot; a slot that
   ends frees its row for the next turn.

The prefill thread runs the prefills of admitted slots (each at batch one in the pinned
prefill step, oldest slot first) while the lane thread decodes: a prompt, however long,
never holds up the decode steps of the others. By default the thread hands each prefill to
the model's prefill process (`prefiller`) and waits: MLX throttles evaluation per process,
so a prefill evaluated in this one slows every decode step beside it 2-3x, and in a process
of its own it does not (with ``prefill_process=False`` the thread evaluates the prefills
itself, one chunk at a time, oldest slot first). A row's bits do
not depend on this: every prefill chunk and every decode step is the same computation
whichever thread or process runs it, and a slot joins the batch only once its whole prefill
is evaluated.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import structlog

from cacheproxy.errors import Overloaded
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.runners.base import Generation, failure
from cacheproxy.runners.rows import RowsCache
from cacheproxy.runners.slot import Slot

DUMMY_TOKEN = 0  # what a free row feeds the model (its outputs are dropped)
WINDOW = 10.0  # seconds of decode steps the rate and the occupancy are taken over
NOTE_EVERY = 60.0  # seconds between two notes that misses queue behind a one-slot lane

log = structlog.get_logger("cacheproxy.runners")


@dataclass(frozen=True, slots=True)
class Job:
    """A generation waiting for a slot."""

    request: CanonicalRequest
    generation: Generation


Planner = Callable[[CanonicalRequest, Generation], Slot]


class QueueNote:
    """Says (a log line, at most once a minute) that misses wait behind a one-slot lane,
    and how many have since it last said so (the status page shows the count)."""

    def __init__(self, model_id: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._model_id = model_id
        self._clock = clock
        self._said = -NOTE_EVERY
        self.queued_behind = 0  # misses that found the lane busy, since start

    def behind(self, queued: int) -> None:
        """A miss joins ``queued`` others on the lane."""
        self.queued_behind += 1
        now = self._clock()
        if now - self._said >= NOTE_EVERY:
            self._said = now
            log.info("misses_queue_behind_one_slot", model=self._model_id, queued=queued,
                     queued_behind=self.queued_behind,
                     hint="--decode-slots S decodes up to S misses together")


class SlotLane:
    """S slots decoded together by one thread (see the module docstring).

    ``pinned=False`` decodes at M = the rows in use instead of S: a diagnostic for the
    exactness test's control only (answers then depend on the neighbours); no setting
    reaches it."""

    def __init__(self, slots: int, plan: Planner, *, pinned: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.size = slots
        self._plan = plan
        self._pinned = pinned
        self._clock = clock
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._rows: list[Slot | None] = [None] * slots
        self._admitted: list[Slot] = []  # in order of admission (prefill goes first-come)
        self._starting = 0  # admitted jobs the lane thread is planning
        self._closed = False
        self._steps: deque[tuple[float, int]] = deque()  # (time, rows in use) per step
        self.decode_steps = 0
        self._thread = threading.Thread(target=self._loop, name="mlx-lane", daemon=True)
        self._prefiller = threading.Thread(target=self._prefill_loop, name="mlx-prefill",
                                           daemon=True)
        self._thread.start()
        self._prefiller.start()

    # -- the event loop's side ------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Generations waiting or in a slot (the queue bound counts them)."""
        with self._cv:
            return len(self._waiting) + self._starting + len(self._admitted)

    def submit(self, request: CanonicalRequest, generation: Generation) -> None:
        """Queue a generation for the next free slot."""
        with self._cv:
            if self._closed:
                raise Overloaded("the runner is shutting down", retry_after=1.0)
            self._waiting.append(Job(request, generation))
            self._cv.notify_all()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the lane thread once every slot is free (none is admitted before)."""
        future: Future[Any] = Future()
        with self._cv:
            self._calls.append((fn, future))
            self._cv.notify_all()
        return future

    def state(self) -> dict[str, float | int]:
        """Slots in use, waiting and prefilling generations, decode rate and occupancy."""
        with self._cv:
            now = self._clock()
            self._forget(now)
            steps = list(self._steps)
            prefilling = sum(not s.decoding for s in self._admitted)
            in_use, waiting = len(self._admitted), len(self._waiting) + self._starting
        tokens = sum(n for _, n in steps)
        span = now - steps[0][0] if len(steps) > 1 else 0.0
        return {"slots": self.size, "slots_in_use": in_use, "waiting": waiting,
                "prefilling": prefilling,
                "decode_tokens_per_s": round(tokens / span, 1) if span > 0 else 0.0,
                "batch_occupancy": round(tokens / (len(steps) * self.size), 3) if steps else 0.0}

    def close(self) -> None:
        """Admit nothing more; the slots in use finish; waiting generations fail."""
        with self._cv:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cv.notify_all()
        for job in waiting:
            job.generation.push(failure(Overloaded("the runner is shutting down",
                                                   retry_after=1.0)))

    def join(self) -> None:
        """Wait for the lane's threads to end (after `close`)."""
        self._thread.join()
        self._prefiller.join()

    # -- the lane thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._has_work():
                    self._cv.wait()
                if self._closed and not self._admitted and not self._calls:
                    self._cv.notify_all()  # (the prefill thread ends too)
                    return
                call = self._calls.popleft() if self._calls and not self._admitted else None
                jobs = self._admit() if call is None and not self._calls else []
                ready = [s for s in self._admitted if not s.joined and
                         (s.decoding or s.failure is not None)]
            if call is not None:
                self._run_call(*call)
                continue
            for row, job in jobs:
                self._start(row, job)
            self._settle(ready)
            self._decode()

    def _has_work(self) -> bool:
        """Whether the lane thread has something to do now (else it waits for a change)."""
        if any(s.joined or s.decoding or s.failure is not None for s in self._admitted):
            return True  # a step to decode, or a slot to settle
        if self._closed or self._calls:  # (nothing is admitted meanwhile)
            return not self._admitted  # to end, or to run the call, once the slots drained
        return bool(self._waiting) and any(r is None for r in self._rows)

    def _settle(self, ready: list[Slot]) -> None:
        for slot in ready:
            if slot.failure is not None:
                self._fail([slot], slot.failure)
            elif slot.ended:
                self._end(slot)
            else:
                slot.joined = True

    def _prefill_loop(self) -> None:
        """The prefill thread: one chunk at a time of the oldest slot still prefilling."""
        while True:
            with self._cv:
                while (slot := self._to_prefill()) is None:
                    if self._closed and not self._admitted and not self._starting:
                        return  # (a job being planned may still join: wait for it)
                    self._cv.wait()
            try:
                slot.prefill_chunk()
            except Exception as exc:  # its generation fails (on the lane thread)
                slot.failure = exc
            if slot.decoding or slot.failure is not None:
                with self._cv:
                    self._cv.notify_all()

    def _to_prefill(self) -> Slot | None:
        return next((s for s in self._admitted if not s.decoding and s.failure is None), None)

    def _admit(self) -> list[tuple[int, Job]]:
        jobs: list[tuple[int, Job]] = []
        for row, slot in enumerate(self._rows):
            if slot is None and self._waiting and not self._closed and \
                    all(r != row for r, _ in jobs):
                jobs.append((row, self._waiting.popleft()))
        self._starting += len(jobs)
        return jobs

    def _run_call(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # the caller sees it
            future.set_exception(exc)

    def _start(self, row: int, job: Job) -> None:
        slot: Slot | None = None
        error: Exception | None = None
        if not job.generation.cancelled:  # (its client left while it waited: nothing to run)
            try:
                slot = self._plan(job.request, job.generation)
            except Exception as exc:  # every failure reaches the waiting request
                error = exc
        with self._cv:  # counted in its slot, or gone, before its request hears of it
            self._starting -= 1
            if slot is not None:
                self._rows[row] = slot
                self._admitted.append(slot)
                self._cv.notify_all()  # (the prefill thread takes it)
        if error is not None:
            job.generation.push(failure(error))

    def _decode(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        rows = [s if s is not None and s.joined else None for s in self._rows]
        active = [s for s in rows if s is not None]
        if not active:
            return
        batch = rows if self._pinned else active
        try:
            with mx.stream(generation_stream):
                model = active[0].plan.model
                layers = [RowsCache([None if s is None else s.cache[n] for s in batch])
                          for n in range(len(active[0].cache))]
                inputs = mx.array([[DUMMY_TOKEN if s is None else s.next_input]
                                   for s in batch])
                logits = model(inputs, cache=layers)[:, -1, :]
                drawn = {id(s): s.sample(logits[i:i + 1]) for i, s in enumerate(batch)
                         if s is not None}
                mx.eval(list(drawn.values()))
        except Exception as exc:  # a failed step fails every generation in it
            self._fail(active, exc)
            return
        self._count_step(len(active))
        for slot in active:
            token, logprobs, decision = drawn[id(slot)]
            try:
                ended = slot.take(int(token.item()), logprobs, decision)
            except Exception as exc:
                self._fail([slot], exc)
                continue
            if ended:
                self._end(slot)

    def _count_step(self, in_use: int) -> None:
        import mlx.core as mx

        self.decode_steps += 1
        if self.decode_steps % 256 == 0:
            mx.clear_cache()  # as generate_step does
        with self._cv:
            now = self._clock()
            self._steps.append((now, in_use))
            self._forget(now)

    def _forget(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - WINDOW:
            self._steps.popleft()

    def _end(self, slot: Slot) -> None:
        self._free(slot)  # first: whoever sees the output sees the slot free
        try:
            slot.finish()
        except Exception as exc:
            slot.generation.push(failure(exc))

    def _fail(self, slots: list[Slot], exc: Exception) -> None:
        for slot in slots:
            self._free(slot)
            slot.generation.push(failure(exc))

    def _free(self, slot: Slot) -> None:
        with self._cv:
            self._admitted.remove(slot)
            self._rows[self._rows.index(slot)] = None
