"""Upstream runner: generate through one or more running mlx_lm.server processes.

The proxy fingerprints the model directory the upstreams serve; the engine versions come
from the upstreams' `system_fingerprint`, read at start-up and from every response. Each
upstream is a lane of one (one generation in flight); a miss goes to the least busy lane.

A fill, in order:
1. pick the least busy member; wait for its lane
2. send exactly the canonical request, streamed, every parameter explicit, seeded
3. relay each delta as a chunk; cut at an OpenAI stop string (then close the stream);
   while nobody streams the answer, the kernel gathers the deltas (fewer wake-ups)
4. a `system_fingerprint` other than the pinned one: re-pin and re-key (so the fill is not
   stored), or exclude the member and retry elsewhere if nothing was relayed yet
5. a refused connection: mark the member down, retry elsewhere; any other failure fails
   the generation, so nothing partial is stored
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path

import orjson
import structlog

from cacheproxy.errors import (
    GenerationFailed,
    Overloaded,
    SchemaViolated,
    Unsupported,
    UpstreamUnavailable,
)
from cacheproxy.keys import fingerprint as fp
from cacheproxy.keys.canonical import CanonicalRequest, RunnerDefaults
from cacheproxy.keys.codec import Output
from cacheproxy.keys.conformance import violation
from cacheproxy.keys.digests import DigestMemo
from cacheproxy.runners.base import Failed, Finished, Generation, failure
from cacheproxy.runners.chat import prompt_length
from cacheproxy.runners.pool import Member, Pool, Retry, pick
from cacheproxy.runners.upstream_http import UpstreamClient
from cacheproxy.runners.upstream_model import ModelFiles, UpstreamOptions, read_model_files
from cacheproxy.runners.upstream_stream import Unreachable
from cacheproxy.runners.upstream_wire import Delta, Reading, path, request_body
from cacheproxy.runners.watcher import Snapshot

log = structlog.get_logger("cacheproxy.upstream")
ENGINE = "mlx_lm.server"


class UpstreamRunner:
    """A Runner over a pool of mlx_lm.server upstreams serving one model directory."""

    def __init__(self, options: UpstreamOptions) -> None:
        if not options.urls:
            raise ValueError("an upstream runner needs at least one upstream URL")
        self._options = options
        self._memo = DigestMemo(options.digest_memo)
        self._pool: Pool | None = None
        self._client: UpstreamClient | None = None
        self._files: ModelFiles | None = None
        self._fingerprint: fp.Fingerprint | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.model_dir: Path | None = options.model_dir
        self.generations = 0
        self.stop_cuts = 0
        # Awaited when a response reveals a new engine (the app wires the Invalidator).
        # Called with the digest it served before.
        self.on_fingerprint_change: Callable[[str], Awaitable[None]] | None = None

    async def start(self) -> None:
        """Read every member's engine, pin the pool's, fingerprint the model directory."""
        self._client = UpstreamClient(timeout=self._options.timeout)
        o = self._options
        pool = self._pool = Pool(o.urls, self._client, device_scope=o.device_scope,
                                 health_interval=o.health_interval, backoff=o.backoff)
        pool.on_move = self._engine_moved
        await pool.refresh()
        if pool.pinned is None:
            urls = ", ".join(m.url for m in pool.members)
            raise UpstreamUnavailable(f"no upstream answered at start-up ({urls})")
        self._files = await asyncio.to_thread(read_model_files, self._options, self._memo)
        self._fingerprint = self._with_engine(self._files.fingerprint)
        await self._check_served_path(pool)
        pool.start_checking()

    async def reload(self) -> fp.Fingerprint:
        """Fingerprint the directory again and re-read every member's engine; on failure
        raise and keep the old state. (The upstreams do not re-read their files by
        themselves: restart them after replacing the model.)"""
        files = await asyncio.to_thread(read_model_files, self._options, self._memo)
        await self._live_pool().refresh()  # the Invalidator registers any change: no announce
        self._files = files
        self._fingerprint = self._with_engine(files.fingerprint)
        return self._fingerprint

    async def aclose(self) -> None:
        """Cancel the health checks and the generations in progress; close the session."""
        if self._pool is not None:
            await self._pool.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    @property
    def loaded_snapshot(self) -> Snapshot:
        """File identities of the model directory as fingerprinted."""
        return self._current().snapshot

    def defaults(self) -> RunnerDefaults:
        """Filled-in parameters; valid after start()."""
        return self._current().defaults

    def fingerprint(self) -> fp.Fingerprint:
        """The model directory's fingerprint with the pool's engine; valid after start()."""
        if self._fingerprint is None:
            raise RuntimeError("runner not started")
        return self._fingerprint

    def prompt_tokens(self, request: CanonicalRequest) -> int:
        """The prompt's length as the upstream renders and tokenizes it (the same files)."""
        return prompt_length(self._current().tokenizer, request)

    def lane_state(self) -> dict[str, object]:
        """queued, busy and lanes over the pool, each upstream's state, the counters."""
        pool = self._live_pool()
        return {**pool.state(), "counters": {**pool.counters, "stop_cuts": self.stop_cuts}}

    def _current(self) -> ModelFiles:
        if self._files is None:
            raise RuntimeError("runner not started")
        return self._files

    def _live_pool(self) -> Pool:
        if self._pool is None:
            raise RuntimeError("runner not started")
        return self._pool

    def _live_client(self) -> UpstreamClient:
        if self._client is None:
            raise RuntimeError("runner not started")
        return self._client

    def _with_engine(self, files: fp.Fingerprint) -> fp.Fingerprint:
        engine = self._live_pool().pinned
        if engine is None:
            raise RuntimeError("no engine pinned")
        return replace(files, engine=ENGINE, engine_version=engine.engine_version,
                       mlx_version=engine.mlx_version, device=engine.device)

    async def _engine_moved(self) -> None:
        """The pool re-pinned its engine: re-key at once, then tell the Invalidator."""
        old = self._fingerprint.digest if self._fingerprint is not None else ""
        self._fingerprint = self._with_engine(self._current().fingerprint)
        log.warning("upstream_fingerprint_changed", fingerprint=self._fingerprint.digest)
        if self.on_fingerprint_change is None:
            return
        try:
            await self.on_fingerprint_change(old)
        except Exception as exc:  # the answer in progress still reaches its client
            log.error("fingerprint_hook_failed", error=f"{type(exc).__name__}: {exc}")

    async def _check_served_path(self, pool: Pool) -> None:
        # A local upstream lists its resolved --model path: catch fingerprinting another one.
        mine = str(self._options.model_dir.resolve())
        for member in pool.members:
            listed = [i for i in await self._live_client().served_models(member.url)
                      if i.startswith("/")]
            if listed and mine not in listed:
                log.warning("upstream_serves_other_model", upstream=member.url, serves=listed,
                            model_dir=mine)

    def generate(self, request: CanonicalRequest, *, reuse_scope: str = "") -> Generation:
        """Queue a generation on the least busy lane; 503 when that lane's queue is full.
        (`reuse_scope` has no use here: nothing is reused in the proxy upstream.)"""
        if request.logprobs:
            raise Unsupported("logprobs are not available through an upstream mlx_lm.server "
                              "(its stream carries none)", param="logprobs")
        if request.tool_choice in ("required", "function"):
            raise Unsupported("mlx_lm.server ignores tool_choice and takes no prefilled answer, "
                              "so upstream mode cannot force a tool call (the in-process "
                              "runner can)", param="tool_choice")
        member = pick(self._live_pool().members)
        if member is None:
            raise UpstreamUnavailable("no upstream may serve: every one runs another engine")
        if member.load >= self._options.queue_size:
            raise Overloaded("the generation queue is full, retry later", retry_after=1.0)
        generation = Generation()
        member.load += 1
        task = asyncio.create_task(self._serve(request, generation, member))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return generation

    async def _serve(self, request: CanonicalRequest, generation: Generation,
                     member: Member) -> None:
        tried: list[Member] = []
        try:
            while True:
                try:
                    output = await self._on(member, request, generation)
                except Retry as retry:
                    tried.append(member)
                    other = pick(self._live_pool().members, tried)
                    if other is None:
                        raise retry.error from None
                    member.load -= 1
                    member = other
                    member.load += 1
                    continue
                if output is not None:
                    _check_structured(request, output)
                    generation.put(Finished(output))
                return
        except asyncio.CancelledError:
            generation.put(Failed(GenerationFailed("the server is shutting down")))
            raise
        except Exception as exc:  # every failure reaches the waiting fill
            generation.put(failure(exc))
        finally:
            member.load -= 1

    async def _on(self, member: Member, request: CanonicalRequest,
                  generation: Generation) -> Output | None:
        async with member.lane:
            if generation.cancelled:
                return None
            member.busy = True
            try:
                return await self._relay(member, request, generation)
            finally:
                member.busy = False

    async def _relay(self, member: Member, request: CanonicalRequest,
                     generation: Generation) -> Output | None:
        """Stream one generation from a member into `generation`; None if cancelled.

        It reads to the end whoever listens: the fill runs detached from its clients, and
        mlx_lm.server would cancel the generation if this connection went away.
        """
        pool = self._live_pool()
        reading = Reading(generation, request, self._current().call_markers)
        self.generations += 1

        def take(d: Delta) -> bool | None:
            # Per token, where it arrives; a new system_fingerprint needs the task (None).
            if member.identity is None or d.fingerprint != member.identity.raw:
                return None
            return generation.cancelled or reading.take(d)

        # Gathered while nobody streams it, unless the proxy may cut it short (a stop string,
        # the one tool call): that must be seen as it comes, to stop the upstream there.
        events = self._live_client().stream(member.url, path(request),
                                            orjson.dumps(request_body(request)), take,
                                            None if reading.may_cut else generation.live)
        try:
            async with aclosing(events):
                async for batch in events:
                    if await self._take(member, batch, reading, generation):
                        break  # closing the stream stops the upstream
        except Unreachable as exc:
            pool.down(member, exc.message)
            raise Retry(exc) from None
        except UpstreamUnavailable as exc:
            if not member.excluded:  # an excluded one answers, with another engine
                pool.down(member, exc.message)
            raise
        if generation.cancelled:
            return None
        pool.up(member)
        member.served += 1
        return await self._finish(member, request, reading)

    async def _take(self, member: Member, batch: list[Delta], reading: Reading,
                    generation: Generation) -> bool:
        """Check and relay deferred events; True to stop reading (cancelled, or cut at a
        stop string)."""
        for d in batch:
            if member.identity is None or d.fingerprint != member.identity.raw:
                await self._live_pool().reported(member, d.fingerprint,
                                                 relayed=bool(reading.chunks))
            if generation.cancelled or reading.take(d):
                return True
        return False

    async def _finish(self, member: Member, request: CanonicalRequest,
                      reading: Reading) -> Output:
        reading.flush()
        if not reading.finish:
            raise UpstreamUnavailable(f"the upstream {member.url} ended without a finish reason")
        usage = reading.usage
        if reading.cut or usage is None:
            # The stream never reached its usage event. One delta is one token on
            # mlx_lm.server (a character split over tokens counts once); the prompt is asked.
            self.stop_cuts += reading.cut
            usage = (await self._prompt_tokens(member, request), reading.deltas)
        return Output(tuple(reading.chunks), reading.finish, usage[0], usage[1],
                      reading.matched)

    async def _prompt_tokens(self, member: Member, request: CanonicalRequest) -> int:
        """The prompt's token count, from a one-token reply (with mlx_lm.server's prompt cache
        on, the prompt is cached by now and this costs about one decoding step)."""
        body = {**request_body(request), "stream": False, "max_tokens": 1}
        del body["stream_options"]
        reply = await self._live_client().complete(member.url, path(request), orjson.dumps(body))
        usage = reply.get("usage")
        return int(usage.get("prompt_tokens", 0)) if isinstance(usage, dict) else 0


def _check_structured(request: CanonicalRequest, output: Output) -> None:
    """Raise SchemaViolated (the fill then stores nothing) unless a structured answer holds
    to its schema: mlx_lm.server generates it unconstrained."""
    why = violation(request, output)
    if why is not None:
        raise SchemaViolated(f"{why}. mlx_lm.server does not constrain decoding, so upstream "
                             "mode checks structured answers and never stores one that "
                             "breaks its schema (the in-process runner enforces it)")
