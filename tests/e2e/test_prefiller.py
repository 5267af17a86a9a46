"""The prefill process of `--decode-slots S > 1` (`runners.prefiller`), with the demo model:
it hands back, bit for bit and in the same buffer layout, the cache a prefill in this process
makes (cold, and from saved prefix chunks); a cancelled prefill ends early; a failed one
fails alone; a prefill whose process dies runs once more in a new one (cold or from saved
chunks), and fails if that one dies too; a process on other files than the runner's is
refused, and no prefill runs until a reload."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheproxy.runners import prefix
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.prefiller import (
    PREFIX,
    ModelFilesMoved,
    PrefillProcess,
    PrefillProcessError,
    sweep,
)
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

    found = prefix.saved(store, ids)[2] if store is not None else []
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
    assert process.prefill([], ids, STEP, lambda: True) is None  # (asked before chunk 2 of 5)
    assert _same(_apart(process, model, _prompt(200))[0], _here(model, _prompt(200)))


def test_a_prefill_the_process_cannot_run_fails_alone(model: Any,
                                                      process: PrefillProcess) -> None:
    pid = process.pid
    with pytest.raises(PrefillProcessError) as failed:
        process.prefill([], _prompt(100), 0, lambda: False)  # a step of 0: range() refuses
    assert failed.value.detail.startswith("a prefill failed: ValueError")
    assert "ValueError" not in failed.value.message  # (the client sees no internals)
    assert process.pid == pid  # the same process goes on
    assert _same(_apart(process, model, _prompt(100))[0], _here(model, _prompt(100)))


def test_a_prefill_whose_process_dies_runs_again_and_fails_if_it_dies_twice(
        model: Any) -> None:
    process = PrefillProcess(BUNDLED_MODEL)
    try:
        process.wait_loaded(snapshot(BUNDLED_MODEL))
        killed: list[int] = []

        def kill(times: int) -> bool:  # (asked first thing, once the prefill is sent)
            if len(killed) < times and process.pid not in killed:
                killed.append(process.pid or 0)
                os.kill(process.pid or 0, signal.SIGKILL)
            return False

        # Once, from saved chunks: it runs again in a new process (the chunks handed again:
        # each attempt writes them for its process) and hands back the cold state.
        store = prefix.PrefixStore(STEP, 1 << 30)
        _here(model, _prompt(3 * STEP + 20, head=2 * STEP + 5), store)
        second = _prompt(4 * STEP + 9, head=2 * STEP + 5)
        apart, reused = _apart(process, model, second, store, cancelled=lambda: kill(1))
        assert reused == 2 * STEP and _same(apart, _here(model, second))
        assert len(killed) == 1 and process.pid not in killed and process.restarts == 1
        # Twice: the prefill fails, saying why in the log (the request: a plain message).
        with pytest.raises(PrefillProcessError) as failed:
            process.prefill([], _prompt(4 * STEP), STEP, lambda: kill(3))
        assert failed.value.detail == "the prefill process ended (exit code -9)"
        assert len(killed) == 3 and process.restarts == 2
    finally:
        process.close()


def test_a_process_on_other_files_than_the_runners_is_refused_at_its_load_and_restart(
        ) -> None:
    """At its load, and when it comes back after a death (on files changed meanwhile), the
    process is refused; after that no prefill runs until a reload (a new process)."""
    process = PrefillProcess(BUNDLED_MODEL)
    try:
        moved = dict(snapshot(BUNDLED_MODEL))  # the runner's files, as if rewritten since
        name = next(iter(moved))
        moved[name] = (moved[name][0] + 1, *moved[name][1:])
        with pytest.raises(ModelFilesMoved, match="prefill process failed"):
            process.wait_loaded(moved)  # at the load: refused
        os.kill(process.pid or 0, signal.SIGKILL)
        with pytest.raises(ModelFilesMoved):  # after a death: the new one is refused too
            process.prefill([], _prompt(100), STEP, lambda: False)
        restarts = process.restarts
        with pytest.raises(PrefillProcessError) as failed:  # and no prefill runs after it
            process.prefill([], _prompt(100), STEP, lambda: False)
        assert failed.value.detail.startswith("the model's files changed since the runner")
        assert process.restarts == restarts == 1  # (no process started for it)
    finally:
        process.close()


def test_a_gone_servers_files_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    """A server killed with its prefill process (a process group's SIGKILL) leaves its files
    directory; the next prefill process started on the machine removes it."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    gone = tmp_path / f"{PREFIX}{ended.stdout.strip()}-abc"
    live = tmp_path / f"{PREFIX}{os.getpid()}-def"
    other = tmp_path / "cacheproxy-prefill-notapid-ghi"
    for path in (gone, live, other):
        (path / "0").mkdir(parents=True)
    sweep(tmp_path)
    assert not gone.exists() and live.exists() and other.exists()
