"""A store URL of no known scheme is refused with every scheme named, jsonl:// included."""

from __future__ import annotations

import pytest

from backends import open_backend


def test_the_unknown_scheme_error_names_every_scheme() -> None:
    with pytest.raises(ValueError) as error:
        open_backend("sqlite:///tmp/x")
    for scheme in ("memory://", "disk://", "redis://", "tiered+", "jsonl://"):
        assert scheme in str(error.value)
