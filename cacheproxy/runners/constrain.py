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
from typing import Any

from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.grammar import COMPACT, answer_grammar, call_schema, enforceable
from cacheproxy.keys.tools import dumps
from cacheproxy.runners.grammars import Grammars, mask_of, too_complex

__all__ = ["Constraint", "Grammars", "call_grammar", "constraint_for"]

_SEPARATORS = {"x-guidance": COMPACT}


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
                   opening: str, initial_state: str, scope: str = "") -> Constraint | None:
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
    return Constraint(grammars, tokenizer, answer=answer, call=call, state=state, first=first,
                      scope=scope)


class Constraint:
    """The logits processor of one generation (see the module docstring)."""

    def __init__(self, grammars: Grammars, tokenizer: Any, *, answer: str | None,
                 call: str | None, state: str, first: str | None, scope: str = "") -> None:
        self._grammars, self._scope = grammars, scope  # (compiled grammars of that scope)
        self._answer, self._call = answer, call
        self._think_end = tuple(tokenizer.think_end_tokens or ())
        self._call_start = tuple(tokenizer.tool_call_start_tokens or ())
        self._call_end = tuple(tokenizer.tool_call_end_tokens or ())
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._state = state
        self._matcher: Any = None
        self._grammar = ""  # the text of the grammar `_matcher` follows
        for grammar in (answer, call):  # any grammar this may use is checked before it starts
            if grammar is not None:
                grammars.matcher(grammar, _param(grammar, answer), scope)
        if state == "call" and first is not None:
            self._follow(first)
        elif state == "answer" and answer is not None:
            self._follow(answer)
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
        return self._masked(logits)

    def _follow(self, grammar: str) -> None:
        self._grammar = grammar
        self._matcher = self._grammars.matcher(grammar, _param(grammar, self._answer),
                                               self._scope)

    def _failed(self) -> Exception:
        """A grammar failed in use: a 400 without parser state, and it is not kept."""
        self._grammars.forget(self._grammar, self._scope)
        error = too_complex(self._matcher, _param(self._grammar, self._answer))
        self._matcher = None  # (the error's traceback holds this processor)
        return error

    def _masked(self, logits: Any) -> Any:
        """-inf where the matcher's packed bitmask has a 0 (numpy and mx.where: CPU, Metal)."""
        import mlx.core as mx
        import numpy as np

        vocab = logits.shape[-1]
        if self._matcher.is_error():
            raise self._failed()
        bitmask = mask_of(self._matcher, vocab, _param(self._grammar, self._answer))
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
        return mx.where(mx.array(allowed.astype(np.bool_)), logits,
                        mx.array(float("-inf"), dtype=logits.dtype))

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
                raise self._failed()
            if self._state == "call" and self._matcher.is_stopped():
                self._matcher, self._state = None, "answer"
                self._forced = list(self._call_end)  # the call is whole: close it
            return
        if self._state == "thought" and self._ends_with(self._think_end):
            self._state = "answer"
            if self._answer is not None:
                self._follow(self._answer)
        elif self._state in ("thought", "answer") and self._call is not None and \
                self._ends_with(self._call_start):  # (mlx-lm parses a call opened in a thought)
            self._state = "call"
            self._follow(self._call)
        elif self._state == "call" and self._ends_with(self._call_end):
            self._state = "answer"  # a call of a tool that is not strict has closed

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        return bool(marker) and tuple(self._seen[-len(marker):]) == marker


def _only(logits: Any, token: int) -> Any:
    import mlx.core as mx

    keep = mx.arange(logits.shape[-1]) == token
    return mx.where(keep, logits, mx.array(float("-inf"), dtype=logits.dtype))


def _param(grammar: str, answer: str | None) -> str:
    """The request field a grammar comes from (the answer's schema, or the tools')."""
    return "response_format" if grammar == answer else "tools"
