"""Turn decoded token text into chunks: OpenAI stop sequences, never a split character.

The streaming detokenizer already holds back incomplete UTF-8; this holds back text
that could still become a stop sequence, and cuts the output before a stop.
"""

from __future__ import annotations

from cacheproxy.keys.codec import Chunk, TokenLogprob


class Assembler:
    """Accumulates tokens and their text; emits chunks at safe boundaries."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._text = ""
        self._emitted = 0
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self.stopped = False

    def add(self, token: int, segment: str, logprob: TokenLogprob | None) -> Chunk | None:
        """Add one generated token and the text it completed; maybe emit a chunk."""
        self._tokens.append(token)
        if logprob is not None:
            self._logprobs.append(logprob)
        self._text += segment
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            return self._emit(cut, force=True)
        return self._emit(len(self._text) - self._held_back())

    def finish(self, segment: str) -> Chunk | None:
        """Flush what is left at the end of generation."""
        if self.stopped:
            return None
        self._text += segment
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            return self._emit(cut, force=True)
        return self._emit(len(self._text), force=True)

    def _find_stop(self) -> int | None:
        if not self._stops:
            return None
        start = max(0, self._emitted - self._longest)
        found = [i for s in self._stops if (i := self._text.find(s, start)) >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        # The longest tail of the text that is a prefix of some stop sequence.
        tail = self._text[self._emitted :]
        for k in range(min(len(tail), self._longest - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self._stops):
                return k
        return 0

    def _emit(self, end: int, *, force: bool = False) -> Chunk | None:
        if end <= self._emitted and not (force and self._tokens):
            return None
        chunk = Chunk(self._text[self._emitted : end], tuple(self._tokens), tuple(self._logprobs))
        self._emitted = max(end, self._emitted)
        self._tokens, self._logprobs = [], []
        return chunk
