"""Parsing a request body: remembered for repeats, and never on the event loop when it is
expensive.

Most bodies parse in microseconds, on the loop. A body that carries schemas (in the fields
its API names: chat's tools, functions and response_format, Responses' text, Messages'
output_config.format...) or is large costs up to seconds of checks
(jsonschema, llguidance), during which the loop would serve nobody, cached HITs included.
Such a body is counted against the `SchemaBudget` and parsed on `ParsePool`'s worker: one
thread, taking the cache scopes (keys, under per-key) in turns; a bounded number of parses
outstanding, of all and of one scope (503 past either); and a budget of CPU time for each
once it runs (400 `schema_too_complex` past it). A repeat of a remembered parse takes neither.

The budget counts the worker thread's CPU time, not the wall clock: what a hostile schema
costs is CPU, and on a loaded server (other processes on the cores, the lane's threads holding
the GIL) a check of a few milliseconds of CPU once waited over 5 s of wall time for its turn,
and an honest request was refused as too complex. A check that neither ends nor spends its
budget is cut after `WALL_FACTOR` times the budget of wall time. (Where the platform has no
clock of a thread's CPU time, macOS among them, the budget is wall time, as it was.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from cacheproxy.errors import Overloaded, SchemaTooComplex
from cacheproxy.keys import budget
from cacheproxy.keys.budget import SchemaBudget
from cacheproxy.keys.canonical import Parsed, Route, RunnerDefaults
from cacheproxy.keys.fields import decode_body
from cacheproxy.service.memos import LRU, MAX_MEMO_BODY, BodyParser
from policies.sampling import SamplingMode

T = TypeVar("T")
INLINE_BODY = 16 << 10  # bodies up to this size are decoded on the loop (tens of us)
WALL_FACTOR = 10  # wall time a check may take, in budgets of CPU time (a backstop)
# A thread's CPU clock (Linux; macOS has none: there the budget is the wall clock's).
CPU_CLOCK: Callable[[int], int] | None = getattr(time, "pthread_getcpuclockid", None)


@dataclass(slots=True)
class _Job:
    """A parse waiting for the worker, and what its request awaits."""

    run: Callable[[], Any]
    started: asyncio.Event
    done: asyncio.Future[Any]
    clock: int | None = None  # the worker thread's CPU clock, once the job runs on it
    at_start: float | None = None  # that clock's reading (or the wall clock's) then

    def on_worker(self) -> Any:
        """What the worker runs: the job, its CPU time measured from here."""
        if CPU_CLOCK is not None:
            self.clock = CPU_CLOCK(threading.get_ident())
            self.at_start = time.clock_gettime(self.clock)
        else:
            self.at_start = time.monotonic()
        return self.run()

    def cpu_spent(self) -> float:
        """CPU seconds the job has used so far on the worker (0 before it began; where the
        platform has no clock of a thread's CPU time, the wall time since it began)."""
        if self.at_start is None:
            return 0.0
        try:
            now = time.monotonic() if self.clock is None else time.clock_gettime(self.clock)
        except OSError:  # its thread is gone (the pool closed): the backstop still holds
            return 0.0
        return now - self.at_start


class ParsePool:
    """The worker that runs expensive parses (see the module docstring), in turns: one job
    of each cache scope with jobs waiting, the scope served longest ago first, so a key
    that floods schemas delays another key's check by one check at most."""

    def __init__(self, *, max_outstanding: int = 256, max_per_scope: int = 32,
                 timeout: float = 5.0) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parse")
        self.max_outstanding, self.max_per_scope = max_outstanding, max_per_scope
        self.timeout = timeout
        self.outstanding = 0  # submitted and not finished (a timed-out one still runs)
        self.started = 0  # jobs started on the worker, ever (a figure for tests and status)
        self._waiting: dict[str, deque[_Job]] = {}
        self._by_scope: Counter[str] = Counter()
        self._turns: dict[str, int] = {}  # scope -> the turn it was last served in
        self._turn = 0
        self._busy = False

    async def run(self, job: Callable[[], T], scope: str = "") -> T:
        """`job()` on the worker; 503 when too many are outstanding (of all, or of this
        scope's), 400 when it uses more than its budget of CPU time (it goes on, counted,
        until it ends: a thread cannot be stopped)."""
        if self.outstanding >= self.max_outstanding or \
                self._by_scope[scope] >= self.max_per_scope:
            raise Overloaded("too many requests with schemas are being checked, retry later")
        loop = asyncio.get_running_loop()
        queued = _Job(job, asyncio.Event(), loop.create_future())
        self._waiting.setdefault(scope, deque()).append(queued)
        self.outstanding += 1
        self._by_scope[scope] += 1
        self._next()
        await queued.started.wait()  # (in turn: each bounded by the budget)
        loop = asyncio.get_running_loop()
        backstop = loop.time() + WALL_FACTOR * self.timeout
        while True:
            # CPU time never runs ahead of the wall clock: the budget cannot be spent before
            # the rest of it has passed on the wall clock.
            left = min(self.timeout - queued.cpu_spent(), backstop - loop.time())
            if left <= 0:
                raise SchemaTooComplex(
                    f"checking the request's schemas took over {self.timeout:g} s of CPU, "
                    "this server's limit")
            try:
                async with asyncio.timeout(left):
                    return cast(T, await asyncio.shield(queued.done))
            except TimeoutError:
                if queued.done.done():  # (it ended as the timer fired)
                    return cast(T, queued.done.result())

    def _next(self) -> None:
        """Start the next job on the worker if it is free: the scope served longest ago."""
        if self._busy or not self._waiting:
            return
        scope = min(self._waiting, key=lambda s: self._turns.get(s, -1))
        queue = self._waiting[scope]
        queued = queue.popleft()
        if not queue:
            del self._waiting[scope]
        self._turn += 1
        self._turns[scope] = self._turn
        self._busy = True
        self.started += 1
        queued.started.set()
        future = asyncio.get_running_loop().run_in_executor(self._executor, queued.on_worker)
        future.add_done_callback(lambda f: self._ended(f, queued, scope))

    def _ended(self, future: asyncio.Future[Any], queued: _Job, scope: str) -> None:
        self._busy = False
        self.outstanding -= 1
        self._by_scope[scope] -= 1
        if not self._by_scope[scope]:
            del self._by_scope[scope]  # (its turn is kept: one per key, a few bytes)
        if not queued.done.done():
            if future.cancelled():
                queued.done.cancel()
            elif (error := future.exception()) is not None:
                queued.done.set_exception(error)
            else:
                queued.done.set_result(future.result())
        self._next()

    def close(self) -> None:
        """Drop the parses not started; the one running ends on its own."""
        self._waiting.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)


class ParseMemo:
    """Repeated identical bodies (of one cache scope) skip JSON decoding and
    canonicalization; expensive first parses run on a `ParsePool`."""

    def __init__(self, parsers: Mapping[Route, BodyParser], max_entries: int = 4096, *,
                 max_tokens_cap: int | None = None, max_answer_tokens: int | None = None,
                 schema_budget: SchemaBudget | None = None,
                 pool: ParsePool | None = None) -> None:
        self._parsers = parsers
        self._memo: LRU[tuple[Route, str, bytes],
                        tuple[RunnerDefaults, SamplingMode, Parsed]] = LRU(max_entries)
        self._cap = max_tokens_cap
        self._budget = max_answer_tokens
        self._schemas = schema_budget or SchemaBudget()
        self.pool = pool  # None: every parse on the caller's thread (a diagnostic)
        self.decodes = 0  # bodies JSON-decoded (a repeat of a remembered one decodes none)

    def known(self, raw: bytes, route: Route, defaults: RunnerDefaults, mode: SamplingMode,
              scope: str = "") -> Parsed | None:
        """The remembered parse of these bytes, while its defaults and mode still hold."""
        found = self._memo.get((route, scope, raw)) if len(raw) <= MAX_MEMO_BODY else None
        if found is not None and found[0] is defaults and found[1] == mode:
            return found[2]
        return None

    def parse(self, raw: bytes, route: Route, defaults: RunnerDefaults, mode: SamplingMode,
              scope: str = "") -> Parsed:
        """The route's parser (the edge's table of APIs) of decode_body(raw) within the
        schema budget, remembered for small bodies, per cache scope; on the caller's
        thread."""
        known = self.known(raw, route, defaults, mode, scope)
        if known is not None:
            return known
        self.decodes += 1
        parsed = self._parse_body(decode_body(raw), self._parsers[route], defaults, mode)
        return self._remember(raw, route, defaults, mode, scope, parsed)

    async def parse_off_loop(self, raw: bytes, route: Route, defaults: RunnerDefaults,
                             mode: SamplingMode, scope: str = "") -> Parsed:
        """`parse` for a body `known` does not hold: on the loop when it is small and
        carries no schema, else on the pool (decoded there too when it is large)."""
        if self.pool is None:
            return self.parse(raw, route, defaults, mode, scope)
        parsed = await self.parse_with(raw, self._parsers[route], defaults, mode, scope)
        return self._remember(raw, route, defaults, mode, scope, parsed)

    async def parse_with(self, raw: bytes, parser: BodyParser, defaults: RunnerDefaults,
                         mode: SamplingMode, scope: str = "") -> Parsed:
        """`parser`'s parse of `raw` (an API's other one, as count_tokens'), within the
        schema budget and where `parse_off_loop` would run it; not remembered."""
        self.decodes += 1
        body = decode_body(raw) if len(raw) <= INLINE_BODY else None
        if self.pool is None or (body is not None and
                                 not budget.carries_schemas(body, parser.schema_fields)):
            return self._parse_body(body if body is not None else decode_body(raw), parser,
                                    defaults, mode)
        decoded = body

        def job() -> Parsed:  # (touches no memo: they belong to the loop's thread)
            whole = decoded if decoded is not None else decode_body(raw)
            return self._parse_body(whole, parser, defaults, mode)

        return await self.pool.run(job, scope)

    def _parse_body(self, body: object, parser: BodyParser, defaults: RunnerDefaults,
                    mode: SamplingMode) -> Parsed:
        """A decoded body's parse, its schemas counted against the budget first."""
        if isinstance(body, dict):
            budget.check(body, self._schemas, parser.schema_fields)
        return parser.parse(body, defaults, mode, max_tokens_cap=self._cap,
                            max_answer_tokens=self._budget)

    def _remember(self, raw: bytes, route: Route, defaults: RunnerDefaults,
                  mode: SamplingMode, scope: str, parsed: Parsed) -> Parsed:
        if len(raw) <= MAX_MEMO_BODY:
            self._memo.put((route, scope, raw), (defaults, mode, parsed), size=2 * len(raw))
        return parsed
