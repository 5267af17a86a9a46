"""structlog set-up: JSON lines off a TTY, readable on a TTY.

JSON lines are written in batches: a write and flush per request costs about a third of a
cache hit. Lines at warning and above flush at once; the rest within `FLUSH_EVERY`
seconds (the app runs the flusher) or when MAX_PENDING lines wait. INFO lines (one per
request) skip the processor chain and render the same JSON directly.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any, BinaryIO, cast

import orjson
import structlog

FLUSH_EVERY = 0.25
MAX_PENDING = 512  # queued lines that trigger a write before the flusher's turn


class IsoTimestamp:
    """ISO-8601 UTC timestamps with microseconds; the date part is formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = b""

    def encoded(self, now: float) -> bytes:
        """The timestamp of `now` (seconds since the epoch), as ASCII bytes."""
        second = int(now)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)).encode()
        return b"%b.%06dZ" % (self._prefix, (now - second) * 1e6)

    def format(self, now: float) -> str:
        """The timestamp of `now` (seconds since the epoch)."""
        return self.encoded(now).decode()

    def __call__(self, _: Any, __: str, event: MutableMapping[str, Any]
                 ) -> MutableMapping[str, Any]:
        event["timestamp"] = self.format(time.time())
        return event


AccessRecord = tuple[str, bytes, float, bytes, float]
"""An access line to render: request id, its fixed fields' JSON (`,"method":…,"total_ms":`),
total ms, the cache log fields' JSON, and the time it was logged."""

# An access line: request id, the fixed fields, total ms, the cache fields, the timestamp.
_ACCESS_LINE = b'{"request_id":%b%b%b%b,"event":"request","level":"info","timestamp":"%b"}\n'


class BatchedLines:
    """A structlog logger that buffers rendered lines and writes them in batches.

    Access lines of repeated answers are queued as records and rendered at the flush, in
    order with the other lines, into one buffer. Rendering each into a bytes object of its
    own on the request path held memory hits at ~0.78 of the bare responder's throughput
    (wrk, c=16 and 64); rendered in batches, 0.85-0.88.
    """

    def __init__(self, stream: BinaryIO, stamp: IsoTimestamp) -> None:
        self._stream = stream
        self._stamp = stamp
        self._buffer = bytearray()  # rendered lines, each ending in a newline
        self._access: list[AccessRecord] = []  # queued after everything in the buffer
        self._lines = 0  # queued in either
        # Lines come from other threads too (the lane's, the store's, printed output): the
        # buffer is taken under a lock. (An access line is queued by the event loop alone,
        # with no lock: the list is swapped, never cleared under a writer.)
        self._lock = threading.Lock()

    def access(self, record: AccessRecord) -> None:
        """Queue an access line."""
        self._access.append(record)
        self._lines += 1
        if self._lines >= MAX_PENDING:
            self.flush()

    def info(self, message: bytes) -> None:
        """Queue one rendered line (also used for debug)."""
        with self._lock:
            if self._access:
                self._render_access()  # they came first
            self._buffer += message
            self._buffer += b"\n"
            self._lines += 1
        if self._lines >= MAX_PENDING:
            self.flush()

    debug = msg = info

    def warning(self, message: bytes) -> None:
        """Queue one line and write everything now."""
        self.info(message)
        self.flush()

    warn = error = critical = exception = fatal = warning

    def notice(self, event: str, message: str, level: str = "info") -> None:
        """A line for the operator (the start-up banner, a warning about the settings),
        whatever the log level: `message` as a field of one JSON line, written at once."""
        self.warning(orjson.dumps({"event": event, "message": message, "level": level,
                                   "timestamp": self._stamp.format(time.time())}))

    def flush(self) -> None:
        """Write what is queued."""
        if not self._lines:
            return
        with self._lock:
            self._render_access()
            data = bytes(self._buffer)
            self._buffer.clear()
            self._lines = 0
        try:
            self._stream.write(data)
            self._stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr must never break a request

    def _render_access(self) -> None:
        encoded, dumps = self._stamp.encoded, orjson.dumps
        records, self._access = self._access, []
        self._buffer += b"".join([_ACCESS_LINE % (
            dumps(request_id), fixed, dumps(total_ms), cache_fields, encoded(logged_at))
            for request_id, fixed, total_ms, cache_fields, logged_at in records])


ACCESS_KEYS = ("request_id", "method", "path", "status", "total_ms")


class SharedFields(dict[str, Any]):
    """Cache log fields shared by the requests of one repeated answer, read-only: their JSON
    is rendered once, and the access line splices it in."""

    __slots__ = ("json",)

    def __init__(self, fields: dict[str, Any]) -> None:
        if any(key in fields for key in (*ACCESS_KEYS, "event", "level", "timestamp")):
            raise ValueError(f"cache log fields may not set the access line's own: {fields}")
        super().__init__(fields)
        self.json = b"," + orjson.dumps(fields, default=repr)[1:-1] if fields else b""

    def _read_only(self, *_: Any, **__: Any) -> Any:
        raise TypeError("shared log fields are read-only")

    __setitem__ = __delitem__ = __ior__ = update = setdefault = pop = popitem = clear = \
        _read_only


AccessWriter = Callable[[str, str, str, int, float, dict[str, Any]], None]


def _lean_json_logger(numeric: int, stamp: IsoTimestamp) -> type[Any]:
    """The filtering logger of `numeric`, whose info() renders the JSON line directly.

    Same fields in the same order as the processor chain below (context, keywords, event,
    level, timestamp); lines with positional arguments or exc_info take the chain.
    """
    base: Any = structlog.make_filtering_bound_logger(numeric)
    if numeric > logging.INFO:
        return cast(type[Any], base)

    fixed_fields: dict[tuple[str, str, int], bytes] = {}  # the access line's fixed fields

    class LeanJson(base):  # type: ignore[misc]
        def info(self, event: str, *args: Any, **kw: Any) -> None:
            if args or "exc_info" in kw:
                super().info(event, *args, **kw)
                return
            self.info_fields(event, kw)  # kw is ours to fill

        def info_fields(self, event: str, fields: dict[str, Any]) -> None:
            """info(event, **fields) without unpacking: `fields` is consumed."""
            if self._context:
                fields = {**self._context, **fields}
            fields["event"], fields["level"] = event, "info"
            fields["timestamp"] = stamp.format(time.time())
            self._logger.info(orjson.dumps(fields, default=repr))

        def access(self, request_id: str, method: str, path: str, status: int,
                   total_ms: float, info: dict[str, Any]) -> None:
            """The access line: ACCESS_KEYS, then the cache log fields."""
            if type(info) is not SharedFields or self._context:
                self.info_fields("request", {
                    "request_id": request_id, "method": method, "path": path,
                    "status": status, "total_ms": total_ms, **info})
                return
            fixed = fixed_fields.get((method, path, status))
            if fixed is None:
                fixed = b',"method":%b,"path":%b,"status":%d,"total_ms":' % (
                    orjson.dumps(method), orjson.dumps(path), status)
                if len(fixed_fields) < 64:  # repeats come from a few routes: this stays small
                    fixed_fields[method, path, status] = fixed
            self._logger.access((request_id, fixed, total_ms, info.json, time.time()))

    return LeanJson


def access_writer(logger: Any) -> AccessWriter:
    """`write(request_id, method, path, status, total_ms, info)`: the access line, straight
    to the lean JSON path when configured."""
    direct = getattr(logger, "access", None)
    if direct is not None:
        return cast(AccessWriter, direct)

    def write(request_id: str, method: str, path: str, status: int, total_ms: float,
              info: dict[str, Any]) -> None:
        logger.info("request", request_id=request_id, method=method, path=path,
                    status=status, total_ms=total_ms, **info)

    return write


def configure(*, fmt: str = "auto", level: str = "info") -> BatchedLines | None:
    """Configure structlog and stdlib logging once, at start-up; returns the batch to flush."""
    batched = None
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    numeric = logging.getLevelNamesMapping()[level.upper()]
    stamp = IsoTimestamp()
    processors: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level,
        stamp,
        structlog.processors.format_exc_info,
    ]
    if as_json:
        batched = BatchedLines(sys.stderr.buffer, stamp)
        atexit.register(batched.flush)
        structlog.configure(
            processors=[*processors, structlog.processors.JSONRenderer(serializer=orjson.dumps)],
            wrapper_class=_lean_json_logger(numeric, stamp),
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
    _route_stdlib_logging(batched, stamp)
    return batched


class _ToBatch(logging.Handler):
    """Another library's record as one more line of the batch, written at once with the
    lines queued before it (so it never jumps ahead of them)."""

    def __init__(self, batched: BatchedLines) -> None:
        super().__init__()
        self._batched = batched

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._batched.warning(self.format(record).encode())
        except Exception:  # a log line must never break its caller
            self.handleError(record)


def _route_stdlib_logging(batched: BatchedLines | None, stamp: IsoTimestamp) -> None:
    """Other libraries' log records (aiohttp, asyncio, transformers), warnings and up, in
    the same format as ours: one JSON line each, in the batch, off a TTY."""
    handler: logging.Handler
    if batched is not None:
        handler = _ToBatch(batched)
        handler.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.JSONRenderer(serializer=_dumps)],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.stdlib.add_log_level,
                               stamp, structlog.processors.format_exc_info]))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    handler.addFilter(one_line_client_errors)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # the access line is ours, one per request
    # Python warnings (warnings.warn: a library's deprecation, say) are records too, not
    # raw "file:line: UserWarning: ..." text among the JSON lines.
    logging.captureWarnings(batched is not None)
    # transformers writes its own "[transformers] ..." lines (the tokenizer's warning of a
    # prompt longer than the model's context, say) unless told to hand them to the root;
    # its advice at import ("PyTorch was not found": mlx needs none) is not for operators.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # not installed: nothing writes those lines
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def one_line_client_errors(record: logging.LogRecord) -> bool:
    """A malformed request (aiohttp's parser refused it: the client's doing) is one line, its
    error's kind and message, not a traceback per request."""
    from aiohttp.http_exceptions import HttpProcessingError

    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, HttpProcessingError):
        detail = " ".join(str(error.message or error).split())[:200]
        record.msg = f"{record.getMessage()}: malformed request: {type(error).__name__}: {detail}"
        record.args, record.exc_info, record.exc_text = None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def _dumps(value: Any, **_: Any) -> str:
    return orjson.dumps(value, default=repr).decode()


async def flush_periodically(batched: BatchedLines) -> None:
    """Write batched log lines every FLUSH_EVERY seconds, until cancelled (then once more)."""
    try:
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            batched.flush()
    finally:
        batched.flush()
