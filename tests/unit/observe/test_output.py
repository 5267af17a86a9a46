"""With JSON logs, lines printed by anything else are JSON lines too (#34)."""

from __future__ import annotations

import io
import sys

import orjson
import pytest

from cacheproxy.observe import output
from cacheproxy.observe.logs import BatchedLines, IsoTimestamp


def test_printed_lines_become_json_lines(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    sink = io.BytesIO()
    batched = BatchedLines(sink, IsoTimestamp())
    print("[WARNING] a library's line")  # control: before the capture, raw text
    assert capsys.readouterr().out == "[WARNING] a library's line\n"
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # (put back after the test)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    output.capture(batched)
    print("[WARNING] a library's line")
    sys.stderr.write("half ")
    sys.stderr.write("a line\r\n")
    print()  # (nothing to say: no line)
    sys.stderr.flush()
    lines = [orjson.loads(line) for line in sink.getvalue().splitlines()]
    assert [(e["logger"], e["level"], e["event"]) for e in lines] == [
        ("stdout", "info", "[WARNING] a library's line"), ("stderr", "warning", "half a line")]
    assert all(e["timestamp"].endswith("Z") for e in lines)
    assert capsys.readouterr() == ("", "")  # nothing reached the streams as text


def test_a_last_line_without_its_newline_is_written_at_the_flush_and_threads_keep_lines_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    sink = io.BytesIO()
    batched = BatchedLines(sink, IsoTimestamp())
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    output.capture(batched)

    def chatter(name: str) -> None:
        for i in range(200):
            sys.stdout.write(f"{name} {i}\n")

    threads = [threading.Thread(target=chatter, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.stdout.write("no newline at the end")
    assert b"no newline" not in sink.getvalue()  # control: held until a newline or a flush
    sys.stdout.flush()
    events = [orjson.loads(line)["event"] for line in sink.getvalue().splitlines()]
    assert sorted(events[:-1]) == sorted(f"{n} {i}" for n in "abc" for i in range(200))
    assert events[-1] == "no newline at the end"
