"""structlog set-up: JSON lines off a TTY, readable on a TTY."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog


def configure(*, fmt: str = "auto", level: str = "info") -> None:
    """Configure structlog and stdlib logging once, at start-up."""
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(serializer=orjson.dumps)
        if as_json
        else structlog.dev.ConsoleRenderer()
    )
    numeric = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.BytesLoggerFactory(sys.stderr.buffer)
        if as_json
        else structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # aiohttp's own loggers: errors only (the access line is ours, one per request).
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
