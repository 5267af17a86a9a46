"""Constrained greedy decoding: llguidance masks the logits wherever a grammar applies.

One `Constraint` per generation, a logits processor of mlx-lm's `generate_step` (the last
one, so no other processor can reopen a masked token). It follows the sampled tokens:
- while the model thinks (the prompt opened a thought), nothing is masked (but a call it
  opens there is held to the call grammar below);
- the answer, when a response_format asks for one, is held to its grammar from its first
  token; once the grammar is complete only an end-of-sequence token may follow;
- a call (tools offered to a model whose calls are JSON) is held to the grammar of one call
  (`{"name": <an offered tool>, "arguments": <its schema>}`; any object for a tool that is
  not strict and whose schema llguidance cannot enforce) from the token after mlx-lm's
  `tool_call_start`, then the call's end marker is forced.
mlx-lm calls a processor with the prompt first, then with one more sampled token each time
(it computes the next step before it yields this one), so the tokens are read off the array.
Masks depend only on the grammar, the tokenizer and the tokens: the same request gets the
same answer, every time.
"""

from __future__ import annotations

import json
from copy import copy
from typing import Any

from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.grammar import COMPACT, answer_grammar, call_schema, enforceable
from cacheproxy.keys.tools import dumps

_SEPARATORS = {"x-guidance": COMPACT}


class Grammars:
    """The llguidance tokenizer of one loaded model and its compiled grammars (by text)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_grammars: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: Any = None
        self._compiled: dict[str, Any] = {}
        self._max = max_grammars

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher of `grammar` (a copy of the one compiled for it: microseconds)."""
        from llguidance import LLMatcher, LLTokenizer

        if self._lltokenizer is None:  # as llguidance.hf.from_tokenizer builds it
            backend = copy(self._tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            self._lltokenizer = LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                            eos_token=sorted(self._tokenizer.eos_token_ids))
        template = self._compiled.get(grammar)
        if template is None:
            template = LLMatcher(self._lltokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"grammar does not compile: {template.get_error()}")
            if len(self._compiled) >= self._max:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[grammar] = template
        return template.deep_copy()


def call_grammar(tools_schema: dict[str, Any], *, named: str | None) -> str:
    """The rest of a call after the model's tool-call opening, as a Lark grammar: the whole
    JSON call, or (a named function, prefilled up to its arguments) the arguments only."""
    from llguidance import LLMatcher

    if named is None:
        body = dumps({**tools_schema, **_SEPARATORS})
        return LLMatcher.grammar_from_lark(f'start: "\\n" call "\\n"\ncall: %json {body}')
    body = dumps({**tools_schema, **_SEPARATORS})
    return LLMatcher.grammar_from_lark(f'start: " " args "}}\\n"\nargs: %json {body}')


def constraint_for(grammars: Grammars, tokenizer: Any, request: CanonicalRequest,
                   opening: str, initial_state: str) -> Constraint | None:
    """The processor a request needs, or None when nothing constrains it. With tools offered
    to a model whose calls are JSON (mlx-lm's json_tools format), every call is held to the
    call grammar: the name of an offered tool, arguments held to its schema (any JSON
    object where the engine cannot enforce a schema that is not strict)."""
    json_calls = bool(request.tools) and \
        tokenizer.init_kwargs.get("tool_parser_type") == "json_tools"
    if not request.response_format and not json_calls:
        return None
    answer = answer_grammar(request.response_format) if request.response_format else None
    call = call_grammar(call_schema(request.tools), named=None) if json_calls else None
    state, first = ("thought" if initial_state == "reasoning" else "answer"), None
    if opening:  # the prompt was prefilled with a call's opening: the rest is constrained
        state, first = "call", call
        if request.tool_choice == "function":
            tool = next(t for t in request.tools if t.name == request.tool_name)
            arguments = json.loads(tool.parameters) if enforceable(tool) else {"type": "object"}
            first = call_grammar(arguments, named=tool.name)
    return Constraint(grammars, tokenizer, answer=answer, call=call, state=state, first=first)


class Constraint:
    """The logits processor of one generation (see the module docstring)."""

    def __init__(self, grammars: Grammars, tokenizer: Any, *, answer: str | None,
                 call: str | None, state: str, first: str | None) -> None:
        self._grammars = grammars
        self._answer, self._call = answer, call
        self._think_end = tuple(tokenizer.think_end_tokens or ())
        self._call_start = tuple(tokenizer.tool_call_start_tokens or ())
        self._call_end = tuple(tokenizer.tool_call_end_tokens or ())
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._state = state
        self._matcher: Any = None
        if state == "call" and first is not None:
            self._matcher = grammars.matcher(first)
        elif state == "answer" and answer is not None:
            self._matcher = grammars.matcher(answer)
        self._forced: list[int] = []  # tokens the grammar leaves no choice about
        self._seen: list[int] = []
        self._prompt: int | None = None
        self._ended = False

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if self._prompt is None:
            self._prompt = int(tokens.size)  # the first call: the prompt, nothing sampled yet
        else:
            for token in tokens[self._prompt + len(self._seen):].tolist():
                self._step(int(token))
        if self._ended:
            return logits
        if self._forced:
            return _only(logits, self._forced[0])
        if self._matcher is None:
            return logits
        return _masked(logits, self._matcher)

    def _step(self, token: int) -> None:
        self._seen.append(token)
        if self._ended or token in self._eos:
            self._ended = True  # (mlx-lm computes one more step after the end: ignored)
            return
        if self._forced:
            self._forced.pop(0)
            return
        if self._matcher is not None:
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}: "
                                   f"{self._matcher.get_error()}")
            if self._state == "call" and self._matcher.is_stopped():
                self._matcher, self._state = None, "answer"
                self._forced = list(self._call_end)  # the call is whole: close it
            return
        if self._state == "thought" and self._ends_with(self._think_end):
            self._state = "answer"
            if self._answer is not None:
                self._matcher = self._grammars.matcher(self._answer)
        elif self._state in ("thought", "answer") and self._call is not None and \
                self._ends_with(self._call_start):  # (mlx-lm parses a call opened in a thought)
            self._state, self._matcher = "call", self._grammars.matcher(self._call)
        elif self._state == "call" and self._ends_with(self._call_end):
            self._state = "answer"  # a call of a tool that is not strict has closed

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        return bool(marker) and tuple(self._seen[-len(marker):]) == marker


def _only(logits: Any, token: int) -> Any:
    import mlx.core as mx

    keep = mx.arange(logits.shape[-1]) == token
    return mx.where(keep, logits, mx.array(float("-inf"), dtype=logits.dtype))


def _masked(logits: Any, matcher: Any) -> Any:
    """-inf where the matcher's packed bitmask has a 0 (numpy and mx.where: CPU and Metal)."""
    import mlx.core as mx
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocab = logits.shape[-1]
    bitmask = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(matcher, bitmask, 0)
    if matcher.is_error():
        raise RuntimeError(f"the grammar failed: {matcher.get_error()}")
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    return mx.where(mx.array(allowed.astype(np.bool_)), logits,
                    mx.array(float("-inf"), dtype=logits.dtype))
