"""`cacheproxy serve` on a taken port: one line, exit 2, no traceback, before a model loads."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest


def test_a_taken_port_is_one_line_and_exit_2() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError):  # control: the port is really taken
            socket.create_server(("127.0.0.1", port)).close()
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "cacheproxy", "serve", "--port", str(port),
                               "--store", "memory://"], capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"cacheproxy: error: port {port} on 127.0.0.1 is in use"]
    assert time.monotonic() - started < 30  # (no model was loaded first)
