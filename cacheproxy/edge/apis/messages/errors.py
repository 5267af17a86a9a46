"""Anthropic's error shape: `{"type": "error", "error": {"type": ..., "message": ...}}`,
its type named by the status as Anthropic names them (the SDK raises by status)."""

from __future__ import annotations

from cacheproxy.edge.apis.messages.request import PATHS
from cacheproxy.errors import ContextLengthExceeded, ProxyError
from cacheproxy.keys.paths import renamed

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "timeout_error"}


def error_body(error: ProxyError) -> dict[str, object]:
    """The error as Anthropic shapes it (the message names the field, as ours all do, by
    its Messages path; a prompt over the context is said as Anthropic says it, which clients
    read the numbers of)."""
    error = renamed(error, PATHS)
    kind = _TYPES.get(error.status, "invalid_request_error" if error.status < 500
                      else "api_error")
    message = error.message
    if isinstance(error, ContextLengthExceeded):
        message = f"prompt is too long: {error.prompt_tokens} tokens > {error.maximum} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}}
