"""The assembler: stop sequences cut the output, held-back text is released, no token is lost."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheproxy.keys.codec import Chunk, TokenLogprob
from cacheproxy.runners.assembler import Assembler
from cacheproxy.runners.demo import model as demo_model

FOX = "🦊"
UNICODE = "héllo 🦊 wörld — ünïcode ✓"


def feed(
    segments: Sequence[str], stops: tuple[str, ...] = (), tail: str = ""
) -> tuple[list[Chunk], Assembler]:
    """Token i carries segments[i]; stop feeding once stopped, then finish with `tail`."""
    assembler = Assembler(stops)
    chunks = []
    for token, segment in enumerate(segments):
        chunk = assembler.add(token, segment, None)
        if chunk is not None:
            chunks.append(chunk)
        if assembler.stopped:
            break
    last = assembler.finish(tail)
    if last is not None:
        chunks.append(last)
    return chunks, assembler


def text_of(chunks: Sequence[Chunk]) -> str:
    return "".join(c.text for c in chunks)


def tokens_of(chunks: Sequence[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.tokens]


def test_no_stops_concatenates_every_segment() -> None:
    segments = ["Hel", "lo", ",", " ", "", "world", "!"]
    chunks, assembler = feed(segments)
    assert text_of(chunks) == "Hello, world!"
    assert tokens_of(chunks) == list(range(len(segments)))
    assert not assembler.stopped


def test_no_stops_emits_a_chunk_per_token_with_text() -> None:
    assembler = Assembler(())
    assert assembler.add(0, "a", None) == Chunk("a", (0,))
    assert assembler.add(1, "", None) is None  # no text yet: the token waits
    assert assembler.add(2, "b", None) == Chunk("b", (1, 2))


def test_stop_split_across_segments_is_cut() -> None:
    chunks, assembler = feed(
        ["The answer", " is 4", "2.", "\n", "\nQ", "uestion: what"], stops=("\n\nQuestion",)
    )
    assert assembler.stopped
    assert text_of(chunks) == "The answer is 42."
    assert tokens_of(chunks) == [0, 1, 2, 3, 4, 5]


def test_stop_in_one_segment_drops_the_rest_of_it() -> None:
    chunks, assembler = feed(["ab", "cSTOPde", "fg"], stops=("STOP",))
    assert assembler.stopped
    assert text_of(chunks) == "abc"
    assert tokens_of(chunks) == [0, 1]


def test_stop_at_the_very_start_gives_an_empty_chunk_with_its_token() -> None:
    chunks, assembler = feed(["ST", "OP", "more"], stops=("STOP",))
    assert assembler.stopped
    assert chunks == [Chunk("", (0, 1))]


def test_nothing_is_emitted_after_a_stop() -> None:
    assembler = Assembler(("X",))
    assert assembler.add(0, "aXb", None) == Chunk("a", (0,))
    assert assembler.stopped
    assert assembler.finish("tail") is None


def test_possible_stop_prefix_is_held_back_then_released() -> None:
    assembler = Assembler(("STOP",))
    assert assembler.add(0, "go ST", None) == Chunk("go ", (0,))
    assert assembler.add(1, "O", None) is None  # "STO" could still become "STOP"
    assert assembler.add(2, "RM", None) == Chunk("STORM", (1, 2))
    assert not assembler.stopped
    assert assembler.finish("") is None


def test_held_back_prefix_restarts_inside_itself() -> None:
    # "aaa" is no prefix of "aab", but its tail "aa" is: only the first "a" is released.
    assembler = Assembler(("aab",))
    assert assembler.add(0, "a", None) is None
    assert assembler.add(1, "a", None) is None
    assert assembler.add(2, "a", None) == Chunk("a", (0, 1, 2))
    assert assembler.add(3, "b", None) == Chunk("", (3,))
    assert assembler.stopped


def test_finish_flushes_held_back_text() -> None:
    chunks, assembler = feed(["the end: S", "TO"], stops=("STOP",), tail="")
    assert not assembler.stopped
    assert text_of(chunks) == "the end: STO"
    assert chunks[-1] == Chunk("STO", (1,))


def test_finish_segment_can_complete_a_stop() -> None:
    chunks, assembler = feed(["a ST"], stops=("STOP",), tail="OP trailing")
    assert assembler.stopped
    assert text_of(chunks) == "a "
    assert tokens_of(chunks) == [0]


def test_finish_with_nothing_pending_emits_nothing() -> None:
    assembler = Assembler(("STOP",))
    assert assembler.add(0, "done", None) == Chunk("done", (0,))
    assert assembler.finish("") is None


def test_finish_without_any_token_emits_nothing() -> None:
    assert Assembler(()).finish("") is None


def test_finish_emits_tokens_that_produced_no_text() -> None:
    assembler = Assembler(())
    assert assembler.add(0, "", None) is None
    assert assembler.finish("") == Chunk("", (0,))


def test_earliest_of_several_stops_wins() -> None:
    chunks, assembler = feed(["one two three"], stops=("three", "two", "zzz"))
    assert assembler.stopped
    assert text_of(chunks) == "one "


def test_stop_completed_first_wins_over_a_longer_one_still_pending() -> None:
    chunks, assembler = feed(["x", "ab", "c", "d"], stops=("abcd", "bc"))
    assert assembler.stopped
    assert text_of(chunks) == "xa"


def test_logprobs_travel_with_their_tokens() -> None:
    assembler = Assembler(("STOP",))
    lps = [TokenLogprob(i, s, -float(i)) for i, s in enumerate(["a", "S", "T", "x"])]
    assert assembler.add(0, "a", lps[0]) == Chunk("a", (0,), (lps[0],))
    assert assembler.add(1, "S", lps[1]) is None
    assert assembler.add(2, "T", lps[2]) is None
    assert assembler.add(3, "x", lps[3]) == Chunk("STx", (1, 2, 3), tuple(lps[1:]))


# Against a reference: the output is the text up to the first stop seen after any token.


def reference(segments: Sequence[str], stops: tuple[str, ...], tail: str) -> tuple[str, int]:
    """(expected text, number of tokens consumed)."""
    text = ""
    for i, segment in enumerate([*segments, tail]):
        text += segment
        hits = [j for s in stops if (j := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], min(i + 1, len(segments))
    return text, len(segments)


pieces = st.text(alphabet="ab\n🦊", max_size=4)


@settings(max_examples=100, deadline=None)
@given(
    segments=st.lists(pieces, max_size=12),
    stops=st.lists(st.text(alphabet="ab\n🦊", min_size=1, max_size=4), max_size=4).map(tuple),
    tail=pieces,
)
def test_matches_reference(segments: list[str], stops: tuple[str, ...], tail: str) -> None:
    chunks, assembler = feed(segments, stops, tail)
    expected, consumed = reference(segments, stops, tail)
    assert text_of(chunks) == expected
    assert tokens_of(chunks) == list(range(consumed))
    assert assembler.stopped == any(s in "".join([*segments, tail]) for s in stops)
    assert not any(s in text_of(chunks) for s in stops)


@settings(max_examples=100, deadline=None)
@given(
    segments=st.lists(pieces, max_size=12),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), max_size=4).map(tuple),
)
def test_holds_back_exactly_the_tail_that_could_still_become_a_stop(
    segments: list[str], stops: tuple[str, ...]
) -> None:
    assembler = Assembler(stops)
    text = emitted = ""
    for token, segment in enumerate(segments):
        text += segment
        chunk = assembler.add(token, segment, None)
        if assembler.stopped:
            break
        emitted += chunk.text if chunk else ""
        held = text[len(emitted) :]
        assert text.startswith(emitted)
        # No stop can start inside what was released...
        for start in range(len(emitted)):
            assert not any(s.startswith(text[start:]) for s in stops)
        # ...and what is held still could become one.
        assert not held or any(s.startswith(held) for s in stops)


# With the real demo tokenizer and mlx-lm's streaming detokenizer.


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from mlx_lm.tokenizer_utils import load

        yield load(Path(demo_model.BUNDLED_MODEL))


def stream(tokenizer: Any, ids: Sequence[int], stops: tuple[str, ...] = ()) -> list[Chunk]:
    """What the MLX runner does with each generated token id."""
    detok = tokenizer.detokenizer
    detok.reset()
    assembler = Assembler(stops)
    chunks = []
    for token in ids:
        detok.add_token(token)
        chunk = assembler.add(token, detok.last_segment, None)
        if chunk is not None:
            chunks.append(chunk)
        if assembler.stopped:
            break
    detok.finalize()
    tail = assembler.finish(detok.last_segment)
    if tail is not None:
        chunks.append(tail)
    return chunks


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_fox_is_several_byte_tokens(tokenizer: Any) -> None:
    assert len(encode(tokenizer, FOX)) == len(FOX.encode())


def test_multibyte_characters_are_never_split(tokenizer: Any) -> None:
    ids = encode(tokenizer, UNICODE)
    chunks = stream(tokenizer, ids)
    assert not any("\ufffd" in c.text for c in chunks)
    assert text_of(chunks) == tokenizer.decode(ids) == UNICODE
    assert tokens_of(chunks) == ids


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("wörld", "héllo 🦊 "),
        (FOX, "héllo "),
        ("🦊 w", "héllo "),
        ("✓", "héllo 🦊 wörld — ünïcode "),
    ],
)
def test_multibyte_stop_sequences(tokenizer: Any, stop: str, expected: str) -> None:
    ids = encode(tokenizer, UNICODE)
    chunks = stream(tokenizer, ids, (stop,))
    assert text_of(chunks) == expected
    assert tokens_of(chunks) == ids[: len(tokens_of(chunks))]
    assert not any("\ufffd" in c.text for c in chunks)


@pytest.mark.parametrize(
    "pieces",
    [
        [2, "abc"],  # the first 2 bytes of the fox, then text
        ["abc", 2],  # ...at the very end: finalize() flushes them
        [2, FOX],  # a broken fox right before a whole one
        [3, " ", 1, "é"],
        [1, 1, 1, "x"],
    ],
    ids=repr,
)
def test_invalid_utf8_does_not_raise_or_split(tokenizer: Any, pieces: list[int | str]) -> None:
    # An int n stands for the token ids of the fox's first n bytes.
    fox_ids = encode(tokenizer, FOX)
    ids = [i for p in pieces for i in (fox_ids[:p] if isinstance(p, int) else encode(tokenizer, p))]
    raw = b"".join(FOX.encode()[:p] if isinstance(p, int) else p.encode() for p in pieces)
    chunks = stream(tokenizer, ids)
    assert text_of(chunks) == raw.decode("utf-8", "replace")
    assert tokens_of(chunks) == ids
    for chunk in chunks:
        chunk.text.encode("utf-8")  # whole characters only: no lone surrogates


@settings(max_examples=50, deadline=None)
@given(
    text=st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Zs")),
        min_size=1,
        max_size=20,
    ),
    data=st.data(),
)
def test_any_text_streams_back_whole(tokenizer: Any, text: str, data: st.DataObject) -> None:
    ids = encode(tokenizer, text)
    chunks = stream(tokenizer, ids)
    assert text_of(chunks) == tokenizer.decode(ids)
    assert not any("\ufffd" in c.text for c in chunks)
    stop = data.draw(
        st.sampled_from(
            [text[i:j] for i in range(len(text)) for j in range(i + 1, min(len(text), i + 4) + 1)]
        )
    )
    decoded = tokenizer.decode(ids)
    if stop in decoded:
        assert text_of(stream(tokenizer, ids, (stop,))) == decoded[: decoded.find(stop)]


def test_the_stop_sequence_that_cut_the_answer_is_named() -> None:
    assembler = Assembler((" eats", "fish"))
    for i, piece in enumerate(["The", " fox", " eats", " fish"]):
        assembler.add(i, piece, None)
    assert assembler.stopped and assembler.matched == " eats"
    free = Assembler((" eats",))
    free.add(0, "The fox", None)
    assert not free.stopped and free.matched == ""
