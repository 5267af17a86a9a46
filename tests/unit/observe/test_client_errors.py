"""A malformed request is one log line (its error's kind and message), not a traceback;
any other exception keeps its traceback."""

from __future__ import annotations

import logging
import sys

from aiohttp.http_exceptions import LineTooLong

from cacheproxy.observe.logs import one_line_client_errors


def _record(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1,
                             "Error handling request from %s", ("127.0.0.1",), info)


def test_a_malformed_request_is_one_line_without_a_traceback() -> None:
    record = _record(LineTooLong("Got more than 8190 bytes when reading: X-Request-Id: rrr"))
    assert one_line_client_errors(record)
    line = logging.Formatter("%(levelname)s %(message)s").format(record)
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("WARNING Error handling request from 127.0.0.1: malformed request: "
                           "LineTooLong: ")


def test_any_other_error_keeps_its_traceback() -> None:  # control
    record = _record(RuntimeError("a bug"))
    assert one_line_client_errors(record)
    assert "Traceback" in logging.Formatter().format(record)
