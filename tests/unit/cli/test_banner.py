"""The start-up banner names every model served."""

from __future__ import annotations

import io

import orjson
import pytest

from cacheproxy.cli.serve import _announce
from cacheproxy.cli.settings import Settings
from cacheproxy.observe.logs import BatchedLines, IsoTimestamp


def test_the_banner_names_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    _announce(Settings(model="alpha=/models/a,beta=/models/b", store="memory://"))
    banner = capsys.readouterr().err
    assert "cacheproxy serving alpha, beta on http://127.0.0.1:8080/v1" in banner
    _announce(Settings(model="/models/a", model_id="solo", store="memory://"))  # control
    assert "cacheproxy serving solo on" in capsys.readouterr().err


def test_with_json_logs_the_banner_and_its_warning_are_json_lines(
        capsys: pytest.CaptureFixture[str]) -> None:
    """(#34) Every line of `serve --log-format json`'s output parses: the banner too."""
    sink = io.BytesIO()
    settings = Settings(model="/models/a", model_id="solo", store="memory://", host="0.0.0.0")
    _announce(settings, BatchedLines(sink, IsoTimestamp()))
    lines = [orjson.loads(line) for line in sink.getvalue().splitlines()]
    assert [(e["event"], e["level"]) for e in lines] == \
        [("no_api_keys", "warning"), ("listening", "info")]
    assert lines[1]["message"].startswith("cacheproxy serving solo on http://0.0.0.0:8080/v1")
    assert capsys.readouterr().err == ""
    _announce(settings)  # control: without JSON logs, the same as raw text
    raw = capsys.readouterr().err.splitlines()
    assert raw[0].startswith("cacheproxy: WARNING: listening on 0.0.0.0 without API keys")
    assert raw[1].startswith("cacheproxy serving solo on")
