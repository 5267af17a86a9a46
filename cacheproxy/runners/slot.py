"""One generation in a slot of the pinned batch: exactly what a lone generation does.

Its prefill runs at batch one in the pinned prefill step (cold, or from a saved prefix as
`prefix.warm` brings it), in the chunks ``generate_step`` would use, and keeps the last
prompt token for the first decode step: one chunk per call on the prefill thread, or, with a
prefill process, the whole prefill in one call there (`prefiller`). Then each decode step
hands it its row of the batch's logits: its own logits processors (penalties, logit bias,
the grammar) see its own token history, its own sampler draws from its own key, its own
detokenizer and assembler turn the token into chunks. Nothing of it is shared with another
slot but the model.

Two threads use a slot, one after the other: the lane's prefill thread until ``decoding``
is set (or ``failure``), then the lane thread.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.codec import Chunk, Output
from cacheproxy.runners import decoding, margins, prefix
from cacheproxy.runners.assembler import Assembler
from cacheproxy.runners.base import Finished, Generation, Prefill
from cacheproxy.runners.prefiller import PrefillProcess


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotPlan:
    """What the runner prepared for one generation (see `MlxRunner._plan`)."""

    model: Any
    tokenizer: Any
    request: CanonicalRequest
    generation: Generation
    ids: list[int]
    assembler: Assembler
    processors: list[Any]
    max_tokens: int
    step: int  # the pinned prefill step
    prefixes: prefix.PrefixStore | None
    prefiller: PrefillProcess | None = None  # None: the prefill runs in this process
    measure_margins: bool = True


class Slot:
    """A generation's state between decode steps (prefill thread, then lane thread)."""

    def __init__(self, plan: SlotPlan) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.plan = plan
        self.generation = plan.generation
        self.cache: list[Any] = make_prompt_cache(plan.model)
        self.decoding = False  # its prefill is done (set on the prefill thread)
        self.joined = False  # it takes its row in the decode steps (set on the lane thread)
        self.next_input = plan.ids[-1]  # the token its row feeds the next decode step
        self._sampler = decoding.KeyedSampler(plan.request)
        self._trail = margins.Trail()
        self._history = list(plan.ids)  # what the logits processors see (prompt + sampled)
        self._detok = plan.tokenizer.detokenizer  # a copy of its own (mlx-lm copies per use)
        self._detok.reset()
        self._eos = plan.tokenizer.eos_token_ids
        self._chunks: list[Chunk] = []
        self._count = 0
        self._finish = "length"
        self.failure: Exception | None = None  # what ended its prefill, if it failed
        self._prefill = self._prefilling()

    def prefill_chunk(self) -> None:
        """Run its prefill up to the next chunk (the first call finds the saved prefix; a
        prompt of one token has no chunk); it is decoding once nothing is left."""
        if self.generation.cancelled:
            self._finish, self.decoding = "cancelled", True
            return
        try:
            next(self._prefill)
        except StopIteration:
            self.decoding = True

    def _prefilling(self) -> Generator[int, None, None]:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        plan, ids = self.plan, self.plan.ids
        if plan.prefiller is not None:
            yield from self._prefilling_apart(plan.prefiller)
            return
        reused = held = 0
        if plan.prefixes is not None:
            reused, held = yield from prefix.warming(plan.prefixes, plan.model, self.cache, ids,
                                                     self.generation.reuse_scope)
        self.generation.push(Prefill(reused, len(ids)))
        rest = ids[held:]
        while len(rest) > 1:  # as generate_step: whole steps, the last token kept back
            n = min(plan.step, len(rest) - 1)
            yield n
            with mx.stream(generation_stream):
                plan.model(mx.array(rest[:n])[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                mx.clear_cache()
            rest = rest[n:]
        with mx.stream(generation_stream):  # (a whole prefix restored and nothing run: its
            mx.eval([c.state for c in self.cache])  # cache is evaluated on this thread too)

    def _prefilling_apart(self, prefiller: PrefillProcess) -> Generator[int, None, None]:
        """`_prefilling` in the prefill process: the same saved prefix and the same chunks
        (``warming``'s, then the rest's, are chunks of the step from the prefix on), its
        chunks saved from the state handed back (positions a later chunk never writes)."""
        import mlx.core as mx

        plan, ids, scope = self.plan, self.plan.ids, self.generation.reuse_scope
        end = len(ids) - 1  # as generate_step: the last token is kept back
        store = plan.prefixes
        aligned, chain, found = prefix.saved(store, ids, scope) if store is not None else \
            (0, [], [])
        reused = len(found) * plan.step
        self.generation.push(Prefill(reused, len(ids)))
        if end <= reused:  # nothing to run: the saved prefix (if any) is the whole state
            if found:
                prefix.restore(self.cache, found, plan.step)
                mx.eval([c.state for c in self.cache])
            return
        yield end - reused
        layers = prefiller.prefill(found, ids[reused:end], plan.step,
                                   lambda: self.generation.cancelled)
        if layers is None:
            self._finish = "cancelled"
            return
        for layer, state in zip(self.cache, layers, strict=True):
            layer.state = state
        if store is not None and aligned > reused:
            store.put(ids, chain, [(c.keys, c.values) for c in self.cache], scope)

    @property
    def ended(self) -> bool:
        """Whether it is over before its next decode step (cancelled, or nothing to make)."""
        return self._finish == "cancelled" or self.plan.max_tokens <= 0

    def sample(self, logits: Any) -> tuple[Any, Any, Any]:
        """Its next token, the log-probabilities it was drawn from and the decision its gap
        is measured from (`margins.Trail.add`'s arguments, or None), from its (1, V) row of a
        decode step's logits (lazy: the lane evaluates every row's at once)."""
        import mlx.core as mx

        if self.plan.processors:
            history = mx.array(self._history)
            for processor in self.plan.processors:
                logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = self._sampler(logprobs)
        decision = (logprobs, token) if self.plan.measure_margins else None
        return token, logprobs.squeeze(0), decision

    def take(self, token: int, logprobs: Any, decision: tuple[Any, Any] | None) -> bool:
        """Add a sampled token (as the lone runner's decode loop does); True once it ended."""
        plan = self.plan
        if self.generation.cancelled:
            self._finish = "cancelled"
            return True
        if decision is not None:
            self._trail.add(*decision)
        if token in self._eos:
            self._finish = "stop"
            return True
        self._count += 1
        self._detok.add_token(token)
        request = plan.request
        lp = decoding.logprob(plan.tokenizer, token, logprobs, request.top_logprobs) \
            if request.logprobs else None
        self._publish(plan.assembler.add(token, self._detok.last_segment, lp))
        if plan.assembler.stopped:
            self._finish = "stop"
            return True
        if self._count >= plan.max_tokens:
            return True  # "length"
        self._history.append(token)
        self.next_input = token
        return False

    def finish(self) -> None:
        """Flush the assembler and deliver the output."""
        self._detok.finalize()
        self._publish(self.plan.assembler.finish(self._detok.last_segment,
                                                 eos=self._finish == "stop"))
        finish = self._finish
        if finish == "stop" and any(c.tool_calls for c in self._chunks):
            finish = "tool_calls"
        margin = self._trail.margin(self._trail.decisions)
        self.generation.push(Finished(Output(tuple(self._chunks), finish, len(self.plan.ids),
                                             self._count, self.plan.assembler.matched,
                                             margin)))

    def _publish(self, chunk: Chunk | None) -> None:
        if chunk is not None:
            self._chunks.append(chunk)
            self.generation.push(chunk)
