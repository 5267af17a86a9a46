"""The prefill process of `--decode-slots S > 1` (`runners.prefiller`), with the demo model:
it hands back, bit for bit and in the same buffer layout, the cache a prefill in this process
makes (cold, and from saved prefix chunks); a cancelled prefill ends early; a failed one
fails alone; a process that dies fails the prefill it ran and the next one starts another."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cacheproxy.runners import prefix
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.prefiller import ModelFilesMoved, PrefillProcess, PrefillProcessError
from cacheproxy.runners.watcher import snapshot

STEP = 64  # a small pinned step: several chunks and a part chunk in a short prompt


@pytest.fixture(scope="module")
def model() -> Any:
    from mlx_lm import load

    return load(str(BUNDLED_MODEL))[0]


@pytest.fixture(scope="module")
def process() -> Iterator[PrefillProcess]:
    p = PrefillProcess(BUNDLED_MODEL)
    p.wait_loaded(snapshot(BUNDLED_MODEL))
    yield p
    p.close()


def _prompt(n: int, head: int = 0) -> list[int]:
    """``n`` token ids; the first ``head`` shared by every prompt, the rest its own."""
    return [(7 * i) % 500 + 3 for i in range(head)] + \
        [(13 * i + n) % 500 + 3 for i in range(head, n)]


def _here(model: Any, ids: list[int], store: prefix.PrefixStore | None = None) -> list[Any]:
    """A lone generation's prefill in this process (`prefix.warm`, then the rest)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    held = prefix.warm(store, model, cache, ids)[1] if store is not None else 0
    prefix.prefill(model, cache, ids[held:-1], STEP)
    return cache


def _apart(process: PrefillProcess, model: Any, ids: list[int],
           store: prefix.PrefixStore | None = None,
           cancelled: Callable[[], bool] = lambda: False) -> tuple[list[Any], int]:
    """The same through the process (from the longest saved prefix); (cache, reused)."""
    from mlx_lm.models.cache import make_prompt_cache

    found: list[prefix.Chunk] = []
    if store is not None:
        aligned = (len(ids) - 1) // STEP * STEP
        found = store.longest(ids, store.chain(ids, aligned))
    reused = len(found) * STEP
    layers = process.prefill(found, ids[reused:-1], STEP, cancelled)
    assert layers is not None
    cache = make_prompt_cache(model)
    for layer, state in zip(cache, layers, strict=True):
        layer.state = state
    return cache, reused


def _same(a: list[Any], b: list[Any]) -> bool:
    import mlx.core as mx

    return all(x.offset == y.offset and x.keys.shape == y.keys.shape and
               mx.array_equal(x.keys, y.keys).item() and
               mx.array_equal(x.values, y.values).item() for x, y in zip(a, b, strict=True))


def test_a_cold_prefill_apart_is_the_prefill_here_bit_for_bit_buffer_included(
        model: Any, process: PrefillProcess) -> None:
    for n in (2, STEP + 1, 3 * STEP + 17, 300):  # one token, a whole chunk, part chunks
        here = _here(model, _prompt(n))
        apart, _ = _apart(process, model, _prompt(n))
        assert _same(here, apart), n
    # The check can fail: another prompt's state is not this one's.
    assert not _same(_here(model, _prompt(300)), _here(model, _prompt(299) + [9]))


def test_a_prefill_apart_from_saved_prefix_chunks_is_the_cold_one(
        model: Any, process: PrefillProcess) -> None:
    store = prefix.PrefixStore(STEP, 1 << 30)
    first = _prompt(3 * STEP + 20, head=2 * STEP + 5)
    _here(model, first, store)  # saves its three whole chunks, two of them shared
    second = _prompt(4 * STEP + 9, head=2 * STEP + 5)
    apart, reused = _apart(process, model, second, store)
    assert reused == 2 * STEP
    assert _same(apart, _here(model, second))  # cold, in this process


def test_a_cancelled_prefill_hands_back_nothing_and_the_next_runs(
        model: Any, process: PrefillProcess) -> None:
    ids = _prompt(5 * STEP)
    assert process.prefill([], ids, STEP, lambda: True) is None  # (asked in its first of 5 chunks)
    assert _same(_apart(process, model, _prompt(200))[0], _here(model, _prompt(200)))


def test_a_prefill_the_process_cannot_run_fails_alone(model: Any,
                                                      process: PrefillProcess) -> None:
    pid = process.pid
    with pytest.raises(PrefillProcessError, match="failed: ValueError"):
        process.prefill([], _prompt(100), 0, lambda: False)  # a step of 0: range() refuses
    assert process.pid == pid  # the same process goes on
    assert _same(_apart(process, model, _prompt(100))[0], _here(model, _prompt(100)))


def test_a_process_that_dies_is_started_again_and_one_that_dies_twice_fails_the_prefill(
        model: Any) -> None:
    process = PrefillProcess(BUNDLED_MODEL)
    try:
        process.wait_loaded(snapshot(BUNDLED_MODEL))
        killed: list[int] = []

        def kill(times: int) -> bool:  # (polled while the prefill runs: it dies mid-prefill)
            if len(killed) < times and process.pid not in killed:
                killed.append(process.pid or 0)
                os.kill(process.pid or 0, signal.SIGKILL)
            return False

        # Once: the prefill runs again in a new process and hands back the same state.
        assert _same(_apart(process, model, _prompt(5 * STEP), cancelled=lambda: kill(1))[0],
                     _here(model, _prompt(5 * STEP)))
        assert len(killed) == 1 and process.pid not in killed
        # Twice: the prefill fails, saying why; the next one starts another process.
        with pytest.raises(PrefillProcessError, match=r"ended \(exit code -9\)"):
            process.prefill([], _prompt(5 * STEP), STEP, lambda: kill(3))
        assert len(killed) == 3
        assert _same(_apart(process, model, _prompt(150))[0], _here(model, _prompt(150)))
        assert process.pid not in killed
    finally:
        process.close()


def test_the_process_refuses_files_other_than_the_runners() -> None:
    process = PrefillProcess(BUNDLED_MODEL)
    try:
        moved = dict(snapshot(BUNDLED_MODEL))
        name = next(iter(moved))
        moved[name] = (moved[name][0] + 1, *moved[name][1:])  # (as if rewritten meanwhile)
        with pytest.raises(ModelFilesMoved, match="changed while the prefill process"):
            process.wait_loaded(moved)
    finally:
        process.close()
