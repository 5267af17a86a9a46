"""Typed readers for JSON request fields: explicit checks, errors that name the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from cacheproxy.errors import InvalidRequest, Unsupported

MISSING: Any = object()


def decode_body(raw: bytes) -> object:
    """JSON body -> Python; 400 on anything that is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _bad(field: str, expected: str, value: object) -> InvalidRequest:
    return InvalidRequest(
        f"'{field}' must be {expected}, got {type(value).__name__}", param=field
    )


def number(
    body: Mapping[str, Any], field: str, default: float, *, lo: float, hi: float
) -> float:
    """A finite number in [lo, hi]; null means the default."""
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(field, "a number", value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidRequest(f"'{field}' must be between {lo} and {hi}", param=field)
    return float(value) + 0.0  # -0.0 -> 0.0: one key for one value


def integer(
    body: Mapping[str, Any], field: str, default: int | None, *, lo: int, hi: int
) -> int | None:
    """An integer in [lo, hi]; a float with no fraction is accepted; null means the default."""
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(field, "an integer", value)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{field}' must be between {lo} and {hi}", param=field)
    return value


def boolean(body: Mapping[str, Any], field: str, default: bool) -> bool:
    """A JSON boolean; null means the default."""
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(field, "a boolean", value)
    return value


def string(body: Mapping[str, Any], field: str, default: str | None = MISSING) -> str:
    """A JSON string; required unless a default is given."""
    value = body.get(field)
    if value is None:
        if default is MISSING or default is None:
            raise InvalidRequest(f"'{field}' is required", param=field)
        return default
    if not isinstance(value, str):
        raise _bad(field, "a string", value)
    return value


def obj(body: Mapping[str, Any], field: str) -> Mapping[str, Any]:
    """A JSON object, or an empty one when absent."""
    value = body.get(field)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(field, "an object", value)
    return value


def stream_options(body: Mapping[str, Any], allowed: frozenset[str]) -> Mapping[str, Any]:
    """`stream_options` with only the keys this server applies: any other is a 400 (never
    dropped), and `include_obfuscation` may only be false."""
    options = obj(body, "stream_options")
    for name in options:
        param = f"stream_options.{name}"
        if name == "include_obfuscation":
            if boolean(options, name, False):
                raise Unsupported(f"'{param}' true is not supported: this server does not pad "
                                  "stream events (a stored stream replays byte for byte)",
                                  param=param)
        elif name not in allowed:
            raise Unsupported(f"'{param}' is not supported by this server", param=param)
    return options


MAX_STOPS = 4
"""OpenAI's bound on `stop` (Anthropic's stop_sequences have their own: edge/apis/messages)."""


def stop_list(body: Mapping[str, Any], field: str = "stop", *,
              most: int = MAX_STOPS) -> tuple[str, ...]:
    """`stop` as a list of up to `most` non-empty strings (a lone string is merged in)."""
    value = body.get(field)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad(field, "a string or a list of strings", value)
    if len(items) > most:
        raise InvalidRequest(f"'{field}' takes at most {most} sequences", param=field)
    if any(s == "" for s in items):
        raise InvalidRequest(f"'{field}' sequences must not be empty", param=field)
    return tuple(sorted(set(items)))


def reject_if_set(body: Mapping[str, Any], field: str, why: str) -> None:
    """Refuse a parameter this proxy cannot honour instead of silently ignoring it."""
    if body.get(field) not in (None, False, [], {}):
        raise Unsupported(f"'{field}' is not supported: {why}", param=field)
