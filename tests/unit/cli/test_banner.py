"""The start-up banner names every model served."""

from __future__ import annotations

import pytest

from cacheproxy.cli.serve import _announce
from cacheproxy.cli.settings import Settings


def test_the_banner_names_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    _announce(Settings(model="alpha=/models/a,beta=/models/b", store="memory://"))
    banner = capsys.readouterr().err
    assert "cacheproxy serving alpha, beta on http://127.0.0.1:8080/v1" in banner
    _announce(Settings(model="/models/a", model_id="solo", store="memory://"))  # control
    assert "cacheproxy serving solo on" in capsys.readouterr().err
