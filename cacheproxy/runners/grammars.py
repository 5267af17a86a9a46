"""The compiled grammars of one loaded model, bounded by what they cost.

A grammar is compiled under llguidance's parser limits (errors without internal state), then
used once the way a generation first uses it: two masks, each followed by an allowed token.
A grammar that fails there, or at any later use, is a 400 `schema_too_complex` naming the
field, and is never cached (a regex bomb fails at its second token and leaves nothing behind).
llguidance tells nothing of the memory a matcher holds, so a grammar's cost is measured: the
growth of the resident set while it is built and first used (at least its text's size). The
cache is bounded both in count and in the sum of those costs, oldest out first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections import OrderedDict
from copy import copy
from dataclasses import dataclass
from typing import Any

from cacheproxy.errors import SchemaTooComplex
from cacheproxy.keys.grammar import plain

_FIRST_STEPS = 2  # a bomb's lexer blows up at its second mask (after the forced quote)


@dataclass(frozen=True, slots=True, kw_only=True)
class GrammarBudget:
    """What one grammar, and the cache of them, may cost."""

    max_grammars: int = 256
    max_bytes: int = 128 << 20  # the sum of the cached grammars' measured costs
    max_text: int = 1 << 20  # a grammar's text (a 900 KB const is refused before building)
    # llguidance's limits (its defaults: 1M, 200k, 250k), lowered so that a regex bomb fails
    # in ~0.2 s and ~20 MB; ~50k fuel a millisecond.
    initial_lexer_fuel: int = 300_000
    step_lexer_fuel: int = 100_000
    max_lexer_states: int = 50_000  # ~1-2 kB each: at most ~100 MB for one grammar


class Grammars:
    """The llguidance tokenizer of one loaded model and its compiled grammars (by scope and
    text: under per-key scope one tenant's requests never find a grammar another's compiled,
    so no request is faster for a schema someone else sent)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 budget: GrammarBudget | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.budget = budget or GrammarBudget()
        self._lltokenizer: Any = None
        self._compiled: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()  # one build at a time: the RSS growth is its own
        self.held_bytes = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def matcher(self, grammar: str, param: str = "response_format", scope: str = "") -> Any:
        """A fresh matcher of `grammar` (a copy of the one compiled for it in `scope`:
        microseconds); SchemaTooComplex (naming `param`) when it cannot be built or first
        used."""
        key = (scope, grammar)
        with self._lock:
            found = self._compiled.get(key)
            if found is None:
                template, cost = self._build(grammar, param)
                self._keep(key, template, cost)
                return template.deep_copy()
            self._compiled.move_to_end(key)
            return found[0].deep_copy()

    def forget(self, grammar: str, scope: str = "") -> None:
        """Drop a grammar that failed in use (so the next request builds and checks it)."""
        with self._lock:
            found = self._compiled.pop((scope, grammar), None)
            if found is not None:
                self.held_bytes -= found[1]

    def _build(self, grammar: str, param: str) -> tuple[Any, int]:
        from llguidance import LLMatcher, LLParserLimits

        if len(grammar) > self.budget.max_text:
            raise SchemaTooComplex(f"'{param}' is too complex to enforce: its grammar is "
                                   f"{len(grammar)} bytes, over {self.budget.max_text}",
                                   param=param)
        b = self.budget
        limits = LLParserLimits(initial_lexer_fuel=b.initial_lexer_fuel,
                                step_lexer_fuel=b.step_lexer_fuel,
                                max_lexer_states=b.max_lexer_states, verbose_errors=False)
        tokenizer = self._llguidance_tokenizer()  # (built once: not this grammar's cost)
        before = _resident_bytes()
        template = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        first = template.deep_copy()  # used as a generation first uses it, then dropped
        for _ in range(_FIRST_STEPS):
            if first.is_error() or first.is_stopped():
                break
            allowed = mask_of(first, self.vocab_size, param, check=False)
            if not first.is_error():
                first.consume_token(_lowest(allowed, self.vocab_size))
        if first.is_error():
            error = too_complex(first, param)
            del template, first  # (a traceback keeps its frames' locals: ~100 MB a bomb)
            _give_back()
            raise error
        return template, max(_resident_bytes() - before, len(grammar))

    def _keep(self, key: tuple[str, str], template: Any, cost: int) -> None:
        if cost > self.budget.max_bytes:
            return  # used by this request only
        while self._compiled and (len(self._compiled) >= self.budget.max_grammars
                                  or self.held_bytes + cost > self.budget.max_bytes):
            self.held_bytes -= self._compiled.popitem(last=False)[1][1]
        self._compiled[key] = (template, cost)
        self.held_bytes += cost

    def _llguidance_tokenizer(self) -> Any:
        from llguidance import LLTokenizer

        if self._lltokenizer is None:  # as llguidance.hf.from_tokenizer builds it
            backend = copy(self._tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            self._lltokenizer = LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                            eos_token=sorted(self._tokenizer.eos_token_ids))
        return self._lltokenizer


def _lowest(bitmask: Any, vocab: int) -> int:
    """The lowest token a packed bitmask allows (what the first-use check consumes)."""
    import numpy as np

    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab])
    return int(allowed[0]) if allowed.size else 0


def mask_of(matcher: Any, vocab: int, param: str, *, check: bool = True) -> Any:
    """The matcher's packed bitmask of allowed next tokens; SchemaTooComplex if it fails."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bitmask = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(matcher, bitmask, 0)
    if check and matcher.is_error():
        raise too_complex(matcher, param)
    return bitmask


def too_complex(matcher: Any, param: str) -> SchemaTooComplex:
    """The error of a matcher that failed: its reason's first line, no parser state."""
    reason = plain(matcher.get_error() or "failed")[:160]
    return SchemaTooComplex(f"'{param}' cannot be enforced: the grammar engine gave up on it "
                            f"({reason})", param=param)


def _give_back() -> None:
    """Return the freed heap of a failed build to the system (glibc keeps it otherwise)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to ask
        ctypes.CDLL(None).malloc_trim(0)


def _resident_bytes() -> int:
    """The process's resident set (Linux /proc; 0 where there is none: cost = text size)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


__all__ = ["GrammarBudget", "Grammars", "mask_of", "too_complex"]
