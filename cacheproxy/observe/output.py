"""With JSON logs, what anything else prints is a JSON line too.

A library that prints (mlx-lm's `[WARNING] ...` lines, a progress bar, a stray `print`)
writes to `sys.stdout` or `sys.stderr`: raw text among the JSON lines, which a log
collector parsing every line drops or chokes on. `capture` puts a writer there that turns
each line into a JSON line of the batch (`{"event": <the line>, "logger": "stdout", ...}`).
Writes below Python (a C library's write(2) to fd 2) are not seen.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from typing import TextIO

import orjson

from cacheproxy.observe.logs import BatchedLines, IsoTimestamp


class JsonLines(io.TextIOBase):
    """A text stream whose every line becomes one JSON line of `batched`."""

    def __init__(self, batched: BatchedLines, name: str, level: str, original: TextIO) -> None:
        super().__init__()
        self._batched, self._name, self._level = batched, name, level
        self._original = original
        self._stamp = IsoTimestamp()
        self._partial = ""
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._original.encoding

    @property
    def buffer(self) -> io.BufferedIOBase | object:
        """The original stream's bytes (raw: whoever writes bytes there meant to)."""
        return getattr(self._original, "buffer", None)

    def fileno(self) -> int:
        return self._original.fileno()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:  # (threads print too: each line whole, in order)
            *lines, self._partial = (self._partial + text).replace("\r", "\n").split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        """Write what is queued, a last line without its newline included."""
        with self._lock:
            line, self._partial = self._partial, ""
        self._line(line)
        self._batched.flush()

    def _line(self, line: str) -> None:
        if line.strip():
            self._batched.warning(orjson.dumps({
                "event": line, "logger": self._name, "level": self._level,
                "timestamp": self._stamp.format(time.time())}))


def capture(batched: BatchedLines) -> None:
    """Turn sys.stdout's and sys.stderr's lines into JSON lines of `batched` (which writes
    to the original stderr's bytes, taken when logging was configured)."""
    sys.stdout = JsonLines(batched, "stdout", "info", sys.stdout)
    sys.stderr = JsonLines(batched, "stderr", "warning", sys.stderr)
