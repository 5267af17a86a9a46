"""The metrics' fold timer on an event loop: it folds with no reader, and a failing fold
does not stop it (the pure parts: tests/unit/observe/test_logs.py)."""

from __future__ import annotations

import asyncio

import pytest

from cacheproxy.observe import metrics
from cacheproxy.observe.metrics import RequestTally


async def test_the_app_timer_folds_without_a_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "FOLD_EVERY", 0.01)
    tally = RequestTally()
    real_fold, calls = tally.fold, 0

    def fold() -> None:  # the first fold fails (a bug), the timer must go on
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in a fold")
        real_fold()

    monkeypatch.setattr(tally, "fold", fold)
    timer = asyncio.create_task(tally.fold_periodically())
    try:
        tally.record(("/v1/chat/completions", 200, 0.001, {"cache": "HIT"}))
        for _ in range(500):  # up to 5 s on a loaded machine
            if tally._by_cache:
                break
            await asyncio.sleep(0.01)
        assert not tally._pending and tally._by_cache == {"HIT": 1} and calls >= 2
        tally.record(("/v1/chat/completions", 200, 0.001, {"cache": "HIT"}))
    finally:
        timer.cancel()
        await asyncio.gather(timer, return_exceptions=True)
    assert tally._by_cache == {"HIT": 2}  # cancelled: folded once more on the way out


