"""A store URL of no known scheme is refused with every scheme named, jsonl:// included; the
redis client is imported for a Redis URL only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backends import open_backend


def test_the_unknown_scheme_error_names_every_scheme() -> None:
    with pytest.raises(ValueError) as error:
        open_backend("sqlite:///tmp/x")
    for scheme in ("memory://", "disk://", "redis://", "tiered+", "jsonl://"):
        assert scheme in str(error.value)


def test_the_redis_client_is_imported_only_for_a_redis_url() -> None:
    """`serve` on memory:// or disk:// does not pay the redis client's import (~0.1 s of every
    start-up); a Redis URL and `backends.RedisBackend` still find it. A fresh interpreter:
    this one has imported redis for other tests."""
    code = (
        "import sys\n"
        "import cacheproxy.cli.main, cacheproxy.cli.serve\n"
        "from backends import open_backend\n"
        "open_backend('memory://'); open_backend('tiered+memory://')\n"
        "assert 'redis' not in sys.modules, 'redis imported'\n"
        "open_backend('redis://127.0.0.1:1/0')\n"
        "assert 'redis' in sys.modules\n"
        "from backends import RedisBackend\n"
        "print(RedisBackend.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "RedisBackend", done.stderr
