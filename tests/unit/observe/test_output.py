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
