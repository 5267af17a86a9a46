"""The one process launcher of the tests: `cacheproxy serve` in a child process on a free
port, healthy before the block runs, stopped with SIGTERM (a clean exit is asserted)."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from tests.conftest import free_port

CLI = [sys.executable, "-m", "cacheproxy"]


@contextmanager
def serving(*args: str, env: dict[str, str] | None = None,
            output: list[str] | None = None) -> Iterator[str]:
    """`python -m cacheproxy serve ARGS` on a free port until the block ends (SIGTERM); its
    output is appended to `output` once it exited."""
    port = free_port()
    # Its output goes to a file, not a pipe nobody reads while it runs (a full pipe would
    # block the server).
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), *args], env=env,
                            stdout=log, stderr=subprocess.STDOUT)

    def text() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")

    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited with {proc.returncode}:\n{text()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        else:
            raise AssertionError("serve did not become healthy within 60 s")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=20) == 0, f"serve did not exit cleanly:\n{text()[-3000:]}"
        finally:
            if proc.poll() is None:
                proc.kill()
            if output is not None:
                output.append(text())
            log.close()
