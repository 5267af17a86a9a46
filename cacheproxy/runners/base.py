"""The Runner protocol: one generation lane, a stream of chunks, then the finished Output."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from cacheproxy.errors import GenerationFailed, ProxyError
from cacheproxy.keys.canonical import CanonicalRequest, RunnerDefaults
from cacheproxy.keys.codec import Chunk, Output
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.runners.live import Live
from cacheproxy.runners.watcher import Snapshot


@dataclass(frozen=True, slots=True)
class Finished:
    """The end of a generation stream."""

    output: Output


@dataclass(frozen=True, slots=True)
class Failed:
    """A generation that ended in an error."""

    error: ProxyError


@dataclass(frozen=True, slots=True)
class Prefill:
    """What a generation's prefill did: prompt tokens taken from a saved state, and all."""

    reused: int
    total: int

    def header(self) -> str:
        """The X-Cache-Prefill header value."""
        return f"reused={self.reused}; total={self.total}"


Event = Chunk | Finished | Failed | Prefill


class Generation:
    """A generation in progress: iterate its chunks; `output` is set once it finished."""

    def __init__(self, *, reuse_scope: str = "") -> None:
        # Whose saved states (prefix states, compiled grammars) it may reuse, and saves its
        # own as: a tenant under per-key scope, "" when they are shared (runners/prefix.py).
        self.reuse_scope = reuse_scope
        # A deque and one waiter, not an asyncio.Queue: a put per token is on the miss path.
        self._events: deque[Chunk | Finished | Failed] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.output: Output | None = None
        self.cancelled = False
        # The fingerprint digest of the model that actually ran it, when the runner knows.
        self.produced_by: str | None = None
        # What its prefill did, when the runner says (before its first chunk).
        self.prefill: Prefill | None = None
        self.on_prefill: Callable[[Prefill], None] | None = None
        self._relay: Callable[[Chunk], None] | None = None  # set while relay() runs
        self.live = Live()  # whether its chunks are awaited as they come

    def push(self, event: Event) -> None:
        """Deliver an event from any thread."""
        self._loop.call_soon_threadsafe(self.put, event)

    def put(self, event: Event) -> None:
        """Deliver an event from the loop's own thread (no cross-thread wake-up per token)."""
        if self._relay is not None and not self._events and type(event) is Chunk:
            # Nothing queued before it: hand it on where it arrives, on the producer's stack
            # (so `publish` must neither raise nor block).
            self._relay(event)
            return
        if isinstance(event, Prefill):
            self.prefill = event
            if self.on_prefill is not None:
                self.on_prefill(event)
            return
        self._events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def cancel(self) -> None:
        """Ask the producer to stop at its next token (or not to start); one that gathers
        its output reads live again, to see the next token."""
        self.cancelled = True
        self.live.start()

    async def relay(self, publish: Callable[[Chunk], None]) -> Output:
        """Hand every chunk to `publish` in order, where it arrives rather than through a
        task woken per token, and return the output; raises the runner's error if it
        failed."""
        self._relay = publish
        try:
            async for chunk in self.chunks():  # only what arrived before, or queued behind it
                publish(chunk)
        finally:
            self._relay = None
        if self.output is None:
            raise RuntimeError("runner ended without an output")
        return self.output

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The chunks as they are generated; raises the runner's error if it failed."""
        events = self._events
        while True:
            while not events:
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            event = events.popleft()
            if isinstance(event, Chunk):
                yield event
            elif isinstance(event, Finished):
                self.output = event.output
                return
            else:
                raise event.error


class Runner(Protocol):
    """Anything that generates canonical requests one at a time."""

    generations: int
    model_dir: Path | None

    @property
    def loaded_snapshot(self) -> Snapshot:
        """File identities of the model as loaded (the watcher compares against them)."""
        ...

    async def reload(self) -> Fingerprint:
        """Load the model files again; on failure raise and keep the old model."""
        ...

    def defaults(self) -> RunnerDefaults:
        """The defaults filled into every canonical request."""
        ...

    def fingerprint(self) -> Fingerprint:
        """The pinned configuration tuple of what generates now."""
        ...

    async def start(self) -> None:
        """Load the model; called once by the app."""
        ...

    def generate(self, request: CanonicalRequest, *, reuse_scope: str = "") -> Generation:
        """Queue a generation (reusing only the saved states of `reuse_scope`, where the
        runner keeps any); raises Overloaded when the lane's queue is full."""
        ...

    def lane_state(self) -> Mapping[str, object]:
        """Queue depth, busy flag and lanes (runners may add more), for /health."""
        ...

    async def aclose(self) -> None:
        """Stop the lane."""
        ...


@runtime_checkable
class PromptCounter(Protocol):
    """A runner that can tell a request's prompt length without generating (its tokenizer
    is at hand): what the Messages API's count_tokens answers."""

    def prompt_tokens(self, request: CanonicalRequest) -> int:
        """The tokens of the prompt `request` is generated from (thread-safe)."""
        ...


def failure(exc: BaseException) -> Failed:
    """Wrap an unexpected exception of a runner thread."""
    if isinstance(exc, ProxyError):
        return Failed(exc)
    return Failed(GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}"))
