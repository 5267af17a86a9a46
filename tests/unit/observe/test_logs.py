"""Log lines and metric families rendered on the request path's short cuts match the
general machinery they stand in for."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import structlog
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from cacheproxy.observe import logs
from cacheproxy.observe.metrics import LATENCY_BUCKETS, Metrics, RequestTally


def _configure_json(monkeypatch: pytest.MonkeyPatch, level: str
                    ) -> tuple[io.BytesIO, logs.BatchedLines]:
    """logs.configure() in JSON mode, writing to a buffer the test can read."""
    sink = io.BytesIO()

    class FakeStderr:  # configure() writes to sys.stderr.buffer
        buffer = sink

        @staticmethod
        def isatty() -> bool:
            return False

        @staticmethod
        def flush() -> None:  # (transformers' logging flushes it when it sets up first)
            return None

    monkeypatch.setattr("sys.stderr", FakeStderr)
    batched = logs.configure(fmt="json", level=level)
    assert batched is not None
    return sink, batched


@pytest.fixture
def json_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[io.BytesIO, logs.BatchedLines]]:
    yield _configure_json(monkeypatch, "info")
    structlog.reset_defaults()
    logging.captureWarnings(False)  # (configure's: undone, or the next one is a no-op)


def _lines(sink: io.BytesIO, batched: logs.BatchedLines) -> list[dict[str, Any]]:
    batched.flush()
    return [orjson.loads(line) for line in sink.getvalue().splitlines()]


def test_info_lines_match_the_processor_chain(
    json_lines: tuple[io.BytesIO, logs.BatchedLines],
) -> None:
    sink, batched = json_lines
    log = structlog.get_logger("t").bind(app="x")
    fields = {"request_id": "r1", "status": 200, "total_ms": 0.5, "odd": {1, 2}}
    log.info("request", **fields)  # the direct rendering
    log.warning("request", **fields)  # the processor chain
    lean, chain = _lines(sink, batched)
    assert list(lean) == list(chain)  # same keys in the same order
    assert lean["timestamp"].endswith("Z") and lean["level"] == "info"
    assert chain["level"] == "warning"
    for key in ("app", "request_id", "status", "total_ms", "event", "odd"):
        assert lean[key] == chain[key]


def test_info_with_exc_info_or_arguments_takes_the_chain(
    json_lines: tuple[io.BytesIO, logs.BatchedLines],
) -> None:
    sink, batched = json_lines
    log = structlog.get_logger("t")
    try:
        raise ValueError("boom")
    except ValueError:
        log.info("failed", exc_info=True)
    log.info("%s items", 3)
    failed, items = _lines(sink, batched)
    assert "ValueError: boom" in failed["exception"]
    assert items["event"] == "3 items"


def test_python_warnings_are_json_lines_too(
    json_lines: tuple[io.BytesIO, logs.BatchedLines],
) -> None:
    """(#34) A library's warnings.warn (at model load, say) is a JSON line among ours, not
    raw "file:line: UserWarning" text."""
    sink, batched = json_lines
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library's advice", UserWarning, stacklevel=1)
        (line,) = _lines(sink, batched)
        assert line["logger"] == "py.warnings" and line["level"] == "warning"
        assert "UserWarning: a library's advice" in line["event"]
        logging.captureWarnings(False)  # control: not captured, it misses the log
        with pytest.warns(UserWarning):
            warnings.warn("again", UserWarning, stacklevel=1)
        assert _lines(sink, batched) == [line]


def test_info_is_dropped_above_info_level(monkeypatch: pytest.MonkeyPatch) -> None:
    sink, batched = _configure_json(monkeypatch, "warning")
    try:
        structlog.get_logger("t").info("request", status=200)
        structlog.get_logger("t").warning("store_unavailable")
        assert [line["event"] for line in _lines(sink, batched)] == ["store_unavailable"]
    finally:
        structlog.reset_defaults()
        logging.captureWarnings(False)


def test_latency_histogram_matches_prometheus_client() -> None:
    ours = Metrics()
    registry = CollectorRegistry()
    reference = Histogram("cacheproxy_request_seconds", "Request latency by cache status",
                          ["cache"], buckets=LATENCY_BUCKETS, registry=registry)
    for seconds in (0.0001, 0.0005, 0.0006, 0.001, 0.3, 60.0, 75.0):  # edges are inclusive
        ours.tally.record(("/v1/chat/completions", 200, seconds, {"cache": "HIT"}))
        reference.labels("HIT").observe(seconds)

    def series(text: bytes) -> set[str]:
        return {line for line in text.decode().splitlines()
                if line.startswith("cacheproxy_request_seconds_")
                and not line.startswith("cacheproxy_request_seconds_created")}

    assert series(ours.render({})) == series(generate_latest(registry))



def test_recorded_requests_count_once_folded_by_a_reader_or_the_timer() -> None:
    minutes = iter([600.0, 661.0])  # one reading per fold that has requests
    tally = RequestTally(clock=lambda: next(minutes))
    hit = logs.SharedFields({"cache": "HIT", "reason": "greedy", "tokens": 7, "runner_ms": 500.0})
    for _ in range(3):
        tally.record(("/v1/chat/completions", 200, 0.001, hit))  # what the edge calls
    tally.record(("/v1/chat/completions", 200, 0.2, {"cache": "MISS", "reason": "greedy",
                                                     "tokens": 7, "runner_ms": 180.0}))
    first = tally.totals()  # a reader folds what was recorded
    assert first.by_cache == {"HIT": 3, "MISS": 1}
    assert (first.saved_tokens, first.saved_seconds) == (21, 1.5)
    assert first.per_minute == [{"minute": 600, "HIT": 3, "MISS": 1}]
    assert tally.totals() == first  # folded once: reading again counts nothing twice
    tally.record(("/health", 200, 0.0001, {}))  # not an API request: no cache status
    tally.record(("/v1/completions", 200, 0.001, hit))
    again = tally.totals()
    assert again.by_cache == {"HIT": 4, "MISS": 1}
    assert again.per_minute[-1] == {"minute": 660, "HIT": 1}
    text = generate_latest(_registry_of(tally)).decode()
    assert 'cacheproxy_requests_total{cache="NONE",endpoint="/health",reason="",status="200"} ' \
        '1.0' in text
    assert 'cacheproxy_generation_seconds_count 1.0' in text




def test_a_malformed_record_does_not_cost_the_others_and_no_minute_is_empty() -> None:
    tally = RequestTally(clock=lambda: 600.0)
    tally.record(("/v1/models", 200, 0.001, {}))  # no cache status: no minute of its own
    assert tally.totals().per_minute == []
    tally.record(("/v1/chat/completions", 200, 0.001, {"cache": "HIT", "runner_ms": "x"}))
    tally.record(("/v1/chat/completions", 200, 0.001, {"cache": "HIT", "tokens": 3}))
    figures = tally.totals()
    assert figures.by_cache == {"HIT": 2} and figures.saved_tokens == 3  # the bad one counts
    assert figures.per_minute == [{"minute": 600, "HIT": 2}]  # up to its bad field


def _registry_of(tally: RequestTally) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(tally)
    return registry

ACCESS = ("r2", "POST", "/v1/chat/completions", 200, 0.07)
ACCESS_FIELDS = dict(zip(logs.ACCESS_KEYS, ACCESS, strict=True))
INFO = {"cache": "HIT", "reason": 'say "hi"\n\x01', "key": "5ad7a78\u00e9", "tokens": 12,
        "runner_ms": 32.693, "odd": {1}}  # escapes, non-ASCII, a value only repr() renders


@pytest.mark.parametrize("info", [INFO, {}], ids=["fields", "no-fields"])
def test_access_lines_are_the_same_whichever_path_renders_them(
    json_lines: tuple[io.BytesIO, logs.BatchedLines], info: dict[str, Any],
) -> None:
    """Shared fields are spliced in as pre-rendered JSON; a plain dict goes through
    info_fields; a logger without the lean path gets keyword arguments."""
    sink, batched = json_lines
    write = logs.access_writer(structlog.get_logger("t").bind())
    assert getattr(write, "__name__", "") == "access"  # the lean path, not the fallback
    write(*ACCESS, logs.SharedFields(info))
    write(*ACCESS, dict(info))
    structlog.get_logger("t").info("request", **ACCESS_FIELDS, **info)
    batched.flush()
    raw = sink.getvalue().splitlines()
    shared, plain, through_info = (orjson.loads(line) for line in raw)
    assert list(shared) == list(plain) == list(through_info)  # same keys, same order
    stamps = [line.pop("timestamp") for line in (shared, plain, through_info)]
    assert shared == plain == through_info
    assert raw[0].replace(stamps[0].encode(), b"") == raw[1].replace(stamps[1].encode(), b"")

    seen: list[tuple[str, dict[str, Any]]] = []

    class PlainLogger:  # any logger without the lean path (e.g. the console renderer's)
        def info(self, event: str, **fields: Any) -> None:
            seen.append((event, fields))

    logs.access_writer(PlainLogger())(*ACCESS, logs.SharedFields(info))
    assert seen == [("request", {**ACCESS_FIELDS, **info})]



def test_queued_access_lines_keep_their_place_among_other_lines(
    json_lines: tuple[io.BytesIO, logs.BatchedLines], monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink, batched = json_lines
    monkeypatch.setattr(logs, "MAX_PENDING", 4)
    write = logs.access_writer(structlog.get_logger("t").bind())
    hit = logs.SharedFields({"cache": "HIT"})
    write("a1", "POST", "/v1/completions", 200, 0.1, hit)  # queued as a record
    structlog.get_logger("t").info("between")  # a rendered line after it
    write("a2", "POST", "/v1/completions", 200, 0.2, hit)
    assert sink.getvalue() == b""  # three lines: below the batch size, nothing written yet
    structlog.get_logger("t").warning("store_unavailable")  # written at once, with all before
    write("a3", "GET", "/v1/models", 404, 0.3, hit)
    for n in range(4, 7):
        write(f"a{n}", "POST", "/v1/completions", 200, 0.4, hit)
    # a3..a6 made four: written without a flush from the timer
    lines = [orjson.loads(line) for line in sink.getvalue().splitlines()]
    assert [line.get("request_id", line["event"]) for line in lines] == \
        ["a1", "between", "a2", "store_unavailable", "a3", "a4", "a5", "a6"]
    assert lines[4] | {"timestamp": ""} == {
        "request_id": "a3", "method": "GET", "path": "/v1/models", "status": 404,
        "total_ms": 0.3, "cache": "HIT", "event": "request", "level": "info",
        "timestamp": ""}
    stamps = [line["timestamp"] for line in lines]
    assert stamps == sorted(stamps)  # each line carries the time it was logged

def test_shared_fields_are_read_only_and_keep_to_their_own_keys() -> None:
    fields = logs.SharedFields({"cache": "HIT"})
    with pytest.raises(TypeError, match="read-only"):
        fields["client"] = "gone"
    with pytest.raises(TypeError, match="read-only"):
        fields.update(client="gone")
    assert fields == {"cache": "HIT"}
    with pytest.raises(ValueError, match="access line"):
        logs.SharedFields({"status": 500})
