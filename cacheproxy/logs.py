"""structlog set-up: JSON lines off a TTY, readable on a TTY.

JSON lines are written in batches: a write and flush per request costs about a third of a
cache hit. Lines at warning and above flush at once; the rest within `FLUSH_EVERY`
seconds (the app runs the flusher) or when the buffer fills.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import time
from collections.abc import MutableMapping
from typing import Any, BinaryIO

import orjson
import structlog

FLUSH_EVERY = 0.25
BUFFER_BYTES = 64 << 10


class BatchedLines:
    """A structlog logger that buffers rendered lines and writes them in batches."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._pending: list[bytes] = []
        self._size = 0

    def info(self, message: bytes) -> None:
        """Queue one line (also used for debug)."""
        self._pending.append(message + b"\n")
        self._size += len(message) + 1
        if self._size >= BUFFER_BYTES:
            self.flush()

    debug = msg = info

    def warning(self, message: bytes) -> None:
        """Queue one line and write everything now."""
        self.info(message)
        self.flush()

    warn = error = critical = exception = fatal = warning

    def flush(self) -> None:
        """Write what is queued."""
        if not self._pending:
            return
        lines, self._pending, self._size = self._pending, [], 0
        try:
            self._stream.write(b"".join(lines))
            self._stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr must never break a request


class IsoTimestamp:
    """ISO-8601 UTC timestamps with microseconds; the date part is formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self, _: Any, __: str, event: MutableMapping[str, Any]
                 ) -> MutableMapping[str, Any]:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        event["timestamp"] = f"{self._prefix}.{int((now - second) * 1e6):06d}Z"
        return event


def configure(*, fmt: str = "auto", level: str = "info") -> BatchedLines | None:
    """Configure structlog and stdlib logging once, at start-up; returns the batch to flush."""
    batched = None
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    numeric = logging.getLevelNamesMapping()[level.upper()]
    processors: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level,
        IsoTimestamp(),
        structlog.processors.format_exc_info,
    ]
    if as_json:
        batched = BatchedLines(sys.stderr.buffer)
        atexit.register(batched.flush)
        structlog.configure(
            processors=[*processors, structlog.processors.JSONRenderer(serializer=orjson.dumps)],
            wrapper_class=structlog.make_filtering_bound_logger(numeric),
            logger_factory=lambda *_: batched,
            cache_logger_on_first_use=True,
        )
    else:
        structlog.configure(
            processors=[*processors, structlog.dev.ConsoleRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(numeric),
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
            cache_logger_on_first_use=True,
        )
    # aiohttp's own loggers: errors only (the access line is ours, one per request).
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
    return batched


async def flush_periodically(batched: BatchedLines) -> None:
    """Write batched log lines every FLUSH_EVERY seconds, until cancelled (then once more)."""
    try:
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            batched.flush()
    finally:
        batched.flush()
