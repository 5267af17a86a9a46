"""Turn decoded token text into chunks: OpenAI stop sequences, never a split character.

The streaming detokenizer already holds back incomplete UTF-8; this holds back answer text
that could still become a stop sequence, and cuts the answer before a stop. A chat
generation passes its text through a `ChatSplit` first: reasoning and tool calls go into
the chunk beside the answer text, and stop sequences apply to the answer text only.
"""

from __future__ import annotations

from typing import Protocol

from cacheproxy.keys.codec import Chunk, TokenLogprob
from cacheproxy.runners.chat import Pieces


class Split(Protocol):
    """Generated text -> answer, reasoning and tool calls (runners.chat.ChatSplit)."""

    done: bool

    def feed(self, text: str) -> Pieces:
        """Split one decoded segment."""
        ...

    def end(self, *, eos: bool) -> Pieces:
        """What is left at the end of generation."""
        ...


class Assembler:
    """Accumulates tokens and their text; emits chunks at safe boundaries."""

    def __init__(self, stops: tuple[str, ...], split: Split | None = None) -> None:
        self._stops = stops
        self._split = split
        self._longest = max((len(s) for s in stops), default=0)
        self._text = ""
        self._emitted = 0
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._side = Pieces()  # reasoning and calls not yet in a chunk
        self.stopped = False  # a stop sequence cut the answer, or its one tool call is made
        self.matched = ""  # the stop sequence that cut it

    def add(self, token: int, segment: str, logprob: TokenLogprob | None) -> Chunk | None:
        """Add one generated token and the text it completed; maybe emit a chunk."""
        self._tokens.append(token)
        if logprob is not None:
            self._logprobs.append(logprob)
        return self._take(self._pieces(segment))

    def finish(self, segment: str, *, eos: bool = False) -> Chunk | None:
        """Flush what is left at the end of generation (`eos`: the model ended it)."""
        if self.stopped:
            return None
        pieces = self._pieces(segment)
        if self._split is not None:
            tail = self._split.end(eos=eos)
            pieces = Pieces(pieces.content + tail.content, pieces.reasoning + tail.reasoning,
                            pieces.calls + tail.calls)
        return self._take(pieces, final=True)

    def _pieces(self, segment: str) -> Pieces:
        return Pieces(segment) if self._split is None else self._split.feed(segment)

    def _take(self, pieces: Pieces, *, final: bool = False) -> Chunk | None:
        self._side.reasoning += pieces.reasoning
        self._side.calls += pieces.calls
        self._text += pieces.content
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            self.matched = next(s for s in self._stops if self._text.startswith(s, cut))
            return self._emit(cut, force=True)
        if self._split is not None and self._split.done:
            self.stopped = True  # parallel_tool_calls false: the one call is made
            return self._emit(len(self._text), force=True)
        if final:
            return self._emit(len(self._text), force=True)
        return self._emit(len(self._text) - self._held_back())

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
        side = self._side
        if end <= self._emitted and not side.reasoning and not side.calls and \
                not (force and self._tokens):
            return None
        chunk = Chunk(self._text[self._emitted : end], tuple(self._tokens),
                      tuple(self._logprobs), side.reasoning, side.calls)
        self._emitted = max(end, self._emitted)
        self._tokens, self._logprobs, self._side = [], [], Pieces()
        return chunk
