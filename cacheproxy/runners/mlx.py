"""In-process MLX runner: one worker thread owns the model; generations run one at a time,
or with `decode_slots` S > 1 up to S together in a decode batch pinned at S rows
(`slots`, `slot`, `rows`).

Every generation is the reproducible kind: batch of one (or a row of the pinned batch), a
fixed prefill step, greedy unless an explicit seed asks for sampling, and a prefill that is
cold or continues from a state a cold prefill passes through (`prefix`: saved at a multiple
of the prefill step, so the answer is bit-identical either way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from cacheproxy.errors import ContextLengthExceeded, Overloaded
from cacheproxy.keys import fingerprint as fp
from cacheproxy.keys.canonical import CanonicalRequest, RunnerDefaults
from cacheproxy.keys.codec import Chunk, Output
from cacheproxy.keys.digests import DigestMemo
from cacheproxy.runners import decoding, margins, prefix
from cacheproxy.runners.assembler import Assembler
from cacheproxy.runners.base import Finished, Generation, Prefill, failure
from cacheproxy.runners.chat import ChatPrompt, ChatSplit, chat_prompt, prompt_length
from cacheproxy.runners.constrain import Grammars, constraint_for
from cacheproxy.runners.mlx_load import (
    PREFILL_STEP,
    PREFIX_CACHE_BYTES,
    Loaded,
    MlxOptions,
    ModelChanging,
    load_model,
    local_fingerprint,
    resolve_model_path,
)
from cacheproxy.runners.slot import Slot, SlotPlan
from cacheproxy.runners.slots import QueueNote, SlotLane
from cacheproxy.runners.watcher import Snapshot

__all__ = ["PREFILL_STEP", "PREFIX_CACHE_BYTES", "Loaded", "MlxOptions", "MlxRunner",
           "ModelChanging", "local_fingerprint", "resolve_model_path"]


class MlxRunner:
    """The in-process runner: mlx_lm.load, a single worker thread, a bounded queue."""

    def __init__(
        self, options: MlxOptions, *, versions: fp.VersionSource = fp.installed_versions
    ) -> None:
        self._options = options
        self._versions = versions
        self._memo = DigestMemo(options.digest_memo)
        self._lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-lane")
        self._slots: SlotLane | None = None  # the lane of --decode-slots S > 1
        self._queue_note = QueueNote(options.model_id)
        self._queued = 0
        self._busy = False
        self._loaded: Loaded | None = None
        self.model_dir: Path | None = None
        self.generations = 0
        self.reloads = 0
        self._prefill_restarts = 0  # of the prefill processes of the models loaded before

    async def start(self) -> None:
        """Load the model on the lane thread and fingerprint its files."""
        self.model_dir = resolve_model_path(self._options.model)
        if self._options.decode_slots > 1:
            self._slots = SlotLane(self._options.decode_slots, self._plan,
                                   pinned=not self._options.unpinned_decode)
        self._loaded = await self._on_lane(self._load, self.model_dir)

    async def reload(self) -> fp.Fingerprint:
        """Load the model files again, after the generation in progress (same lane).

        On failure the old model keeps serving and the error propagates to the caller.
        """
        if self.model_dir is None:
            raise RuntimeError("runner not started")
        # (With slots, once they drain: a batch never mixes two models.)
        self._loaded = await self._on_lane(self._reload, self.model_dir)
        self.reloads += 1
        return self._loaded.fingerprint

    async def _on_lane(self, fn: Callable[[Path], Loaded], path: Path) -> Loaded:
        if self._slots is not None:
            return cast(Loaded, await asyncio.wrap_future(self._slots.call(lambda: fn(path))))
        return await asyncio.get_running_loop().run_in_executor(self._lane, fn, path)

    def _reload(self, path: Path) -> Loaded:
        # The saved prefix states belong to the model being replaced: freed before the new
        # one loads, not held beside it (if the load fails, the old model serves cold).
        old = self._loaded
        if old is not None and old.prefixes is not None:
            old.prefixes.clear()
        new = self._load(path)
        # Swapped in here, on the lane thread, before the lane takes its next generation:
        # one admitted right after this call returns must see the new model (set later, on
        # the event loop, it could still plan on the old one).
        self._loaded = new
        if old is not None and old.prefiller is not None:
            self._prefill_restarts += old.prefiller.restarts  # (the lane's count goes on)
            old.prefiller.close()  # (the slots drained: nothing of the old model runs)
        return new

    def _load(self, path: Path) -> Loaded:
        return load_model(self._options, path, versions=self._versions, memo=self._memo)

    @property
    def loaded_snapshot(self) -> Snapshot:
        """File identities of the model as loaded (the watcher compares against them)."""
        return self._current().snapshot

    def _current(self) -> Loaded:
        if self._loaded is None:
            raise RuntimeError("runner not started")
        return self._loaded

    def defaults(self) -> RunnerDefaults:
        """Filled-in parameters; valid after start()."""
        return self._current().defaults

    def fingerprint(self) -> fp.Fingerprint:
        """The pinned tuple of the loaded model; valid after start()."""
        loaded = self._loaded  # (_current() inlined: this is on every repeat HIT)
        if loaded is None:
            raise RuntimeError("runner not started")
        return loaded.fingerprint

    @property
    def tokenizer(self) -> Any:
        """The loaded tokenizer (mlx-lm's TokenizerWrapper)."""
        return self._current().tokenizer

    @property
    def grammars(self) -> Grammars:
        """The compiled grammars of the model loaded now (their cache and its cost)."""
        return self._current().grammars

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits."""
        return self._current().grammars.vocab_size

    def prompt_tokens(self, request: CanonicalRequest) -> int:
        """The length of the prompt `request` is generated from (the loaded tokenizer)."""
        return prompt_length(self.tokenizer, request)

    def lane_state(self) -> dict[str, float | int]:
        """Queued jobs, whether one is generating, the slots' figures (with S > 1: and how
        often a prefill process was started again since the runner started) and the prefix
        store's."""
        state: dict[str, float | int] = {"queued": self._queued, "busy": int(self._busy),
                                         "lanes": 1}
        if self._slots is not None:
            slots = self._slots.state()
            state.update(slots, queued=self._slots.outstanding,
                         busy=int(slots["slots_in_use"] > 0))
        else:
            state.update(slots=1, slots_in_use=int(self._busy),
                         queued_behind=self._queue_note.queued_behind)
        prefixes = self._loaded.prefixes if self._loaded is not None else None
        if prefixes is not None:
            state.update(prefixes.state())
        prefiller = self._loaded.prefiller if self._loaded is not None else None
        if prefiller is not None:
            state.update(prefill_restarts=self._prefill_restarts + prefiller.restarts)
        return state

    def generate(self, request: CanonicalRequest, *, reuse_scope: str = "") -> Generation:
        """Queue a generation on the lane (reusing only the prefix states and compiled
        grammars of `reuse_scope`); 503 when the queue is full."""
        queued = self._queued if self._slots is None else self._slots.outstanding
        if queued >= self._options.queue_size:
            raise Overloaded("the generation queue is full, retry later", retry_after=1.0)
        generation = Generation(reuse_scope=reuse_scope)
        if self._slots is not None:
            self._slots.submit(request, generation)
            return generation
        if queued and self._options.note_queueing:
            self._queue_note.behind(queued)
        self._queued += 1
        future = asyncio.get_running_loop().run_in_executor(
            self._lane, self._run, request, generation
        )
        future.add_done_callback(lambda _: self._dequeue())
        return generation

    def _dequeue(self) -> None:
        self._queued -= 1

    def _run(self, request: CanonicalRequest, generation: Generation) -> None:
        if generation.cancelled:
            return
        self._busy = True
        try:
            generation.push(Finished(self._generate(request, generation)))
        except Exception as exc:  # every failure reaches the waiting request
            generation.push(failure(exc))
        finally:
            self._busy = False

    def _prompt(self, tok: Any, request: CanonicalRequest) -> tuple[ChatPrompt, Assembler]:
        """The prompt's token ids, and the assembler that turns the answer into chunks."""
        if request.endpoint == "chat":
            prompt = chat_prompt(tok, request)
            return prompt, Assembler(request.stop, ChatSplit(tok, request, prompt))
        ids = list(tok.encode(request.prompt, add_special_tokens=True))
        return ChatPrompt(ids), Assembler(request.stop)

    def _checked(self, loaded: Loaded, request: CanonicalRequest,
                 generation: Generation) -> tuple[ChatPrompt, Assembler, int]:
        """The prompt, its assembler and its max tokens, once the context is checked."""
        generation.produced_by = loaded.fingerprint.digest
        prompt, assembler = self._prompt(loaded.tokenizer, request)
        context = loaded.defaults.context_length
        if len(prompt.ids) >= context:
            raise ContextLengthExceeded(
                len(prompt.ids), context,
                param="messages" if request.endpoint == "chat" else "prompt")
        self.generations += 1
        return prompt, assembler, min(request.max_tokens, context - len(prompt.ids))

    def _generate(self, request: CanonicalRequest, generation: Generation) -> Output:
        loaded = self._current()  # fixed for this generation: a reload waits for the lane
        prompt, assembler, max_tokens = self._checked(loaded, request, generation)
        trail = margins.Trail()  # (left empty when margins are not measured: no margin)
        steps = self._steps(loaded, request, prompt, generation, max_tokens, trail)
        chunks, finish, count, decided = self._decode(loaded.tokenizer, request, steps,
                                                      assembler, generation)
        return Output(tuple(chunks), finish, len(prompt.ids), count, assembler.matched,
                      trail.margin(decided))

    def _plan(self, request: CanonicalRequest, generation: Generation) -> Slot:
        """A generation's slot in the pinned batch (on the lane thread, as it is admitted)."""
        loaded = self._current()  # fixed while it decodes: a reload waits for the slots
        prompt, assembler, max_tokens = self._checked(loaded, request, generation)
        return Slot(SlotPlan(
            model=loaded.model, tokenizer=loaded.tokenizer, request=request,
            generation=generation, ids=list(prompt.ids), assembler=assembler,
            processors=self._processors(loaded, request, prompt, decoding.processors(request),
                                        generation.reuse_scope),
            max_tokens=max_tokens, step=self._options.prefill_step, prefixes=loaded.prefixes,
            prefiller=loaded.prefiller, measure_margins=self._options.measure_margins))

    def _processors(self, loaded: Loaded, request: CanonicalRequest, prompt: ChatPrompt,
                    processors: list[Any], scope: str) -> list[Any]:
        """A request's logits processors, its grammar's constraint last (if any; compiled
        grammars reused within `scope`)."""
        constraint = constraint_for(loaded.grammars, loaded.tokenizer, request, prompt.opening,
                                    prompt.initial_state, scope) \
            if request.endpoint == "chat" else None
        if constraint is not None:
            processors = [*processors, constraint]  # last: nothing reopens a masked token
        return processors

    def _steps(self, loaded: Loaded, request: CanonicalRequest, prompt: ChatPrompt,
               generation: Generation, max_tokens: int, trail: margins.Trail) -> Any:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        sampler, processors = decoding.sampling(request)
        processors = self._processors(loaded, request, prompt, processors,
                                      generation.reuse_scope)
        ids, cache, reused, held = prompt.ids, make_prompt_cache(loaded.model), 0, 0
        if loaded.prefixes is not None:
            # The cache brought to where a cold prefill of this prompt passes a multiple of
            # the step (from a saved state when one holds a prefix); generate_step goes on
            # from there in the chunks it would have used.
            reused, held = prefix.warm(loaded.prefixes, loaded.model, cache, ids,
                                       generation.reuse_scope)
            processors = prefix.with_history(processors, ids[:held])
        generation.push(Prefill(reused, len(ids)))
        return generate_step(
            mx.array(ids[held:]), loaded.model, max_tokens=max_tokens,
            sampler=margins.MeasuringSampler(sampler, trail)
            if self._options.measure_margins else sampler,
            logits_processors=processors, prompt_cache=cache,
            prefill_step_size=self._options.prefill_step)

    def _decode(self, tokenizer: Any, request: CanonicalRequest, steps: Any,
                assembler: Assembler, generation: Generation
                ) -> tuple[list[Chunk], str, int, int]:
        """Detokenize and assemble the generated tokens; (chunks, finish reason, count,
        decisions: the tokens taken, and the end-of-sequence one if it ended the answer)."""
        detok = tokenizer.detokenizer
        detok.reset()
        eos = tokenizer.eos_token_ids
        finish, count, chunks, ended_on_eos = "length", 0, [], 0

        def publish(chunk: Chunk | None) -> None:
            if chunk is not None:
                chunks.append(chunk)
                generation.push(chunk)

        for step_token, logprobs in steps:
            token = int(step_token)
            if generation.cancelled:
                finish = "cancelled"
                break
            if token in eos:
                finish, ended_on_eos = "stop", 1
                break
            count += 1
            detok.add_token(token)
            lp = decoding.logprob(tokenizer, token, logprobs, request.top_logprobs) \
                if request.logprobs else None
            publish(assembler.add(token, detok.last_segment, lp))
            if assembler.stopped:
                finish = "stop"
                break
        detok.finalize()
        publish(assembler.finish(detok.last_segment, eos=finish == "stop"))
        if finish == "stop" and any(c.tool_calls for c in chunks):
            finish = "tool_calls"
        return chunks, finish, count, count + ended_on_eos

    async def aclose(self) -> None:
        """Stop accepting work and wait for the lane's threads (and the prefill thread at
        S > 1) to finish.

        The thread must be gone before the interpreter exits: MLX aborts the process
        ("terminate called without an active exception") if a thread that used it is still
        alive while its C++ state is torn down.
        """
        self._lane.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._lane.shutdown, wait=True)
        if self._slots is not None:
            self._slots.close()
            await asyncio.to_thread(self._slots.join)
        if self._loaded is not None and self._loaded.prefiller is not None:
            await asyncio.to_thread(self._loaded.prefiller.close)
