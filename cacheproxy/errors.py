"""One rooted exception tree, rendered as OpenAI-shaped errors in one place."""

from __future__ import annotations

from typing import ClassVar

from policies.status import CacheStatus, Reason


class ProxyError(Exception):
    """Root of every error that becomes an HTTP response."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    cache_log: dict[str, object] | None = None  # the cache fields of its access line, if any
    closes: ClassVar[bool] = False  # the connection is closed after this answer

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, object]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Extra response headers this error needs."""
        return {}


class InvalidRequest(ProxyError):
    """Malformed JSON, wrong types, values out of range."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request_error"  # a real code on every 400, never null


class ContextLengthExceeded(InvalidRequest):
    """The prompt does not fit the model's context (with one token to answer)."""

    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, context: int, *, param: str | None = None) -> None:
        super().__init__(f"the prompt is {prompt_tokens} tokens; this model's context is "
                         f"{context} tokens", param=param)
        self.prompt_tokens = prompt_tokens
        self.maximum = context - 1  # the longest prompt it takes: one token is left to answer


class Unsupported(InvalidRequest):
    """A valid OpenAI parameter this proxy does not serve."""

    code = "unsupported_parameter"


class SchemaTooComplex(InvalidRequest):
    """A schema whose grammar exceeds what the engine may spend on one (its build or its
    first use failed, or went over a budget): never cached, never a 500."""

    code = "schema_too_complex"


class Unauthorized(ProxyError):
    """Missing or wrong API key / admin token."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    # Closed at once: the body of a caller without a key is never read (nor lingered on).
    closes = True


class Forbidden(ProxyError):
    """A request this proxy refuses whoever sends it (a browser's, on another site's behalf)."""

    status = 403
    type = "invalid_request_error"
    code = "forbidden"


class CrossSiteRefused(Forbidden):
    """A browser's request from another site (Origin, or a Content-Type no API client sends)."""

    code = "cross_site_request"


class HostNotAllowed(Forbidden):
    """A Host header that names another machine (DNS rebinding)."""

    code = "host_not_allowed"


class ModelNotFound(ProxyError):
    """The request names a model this proxy does not serve."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFound(ProxyError):
    """No such endpoint."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(ProxyError):
    """Endpoint exists, method does not."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(ProxyError):
    """Request body over the configured limit."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ExpectationFailed(ProxyError):
    """An `Expect` header other than 100-continue."""

    status = 417
    type = "invalid_request_error"
    code = "expectation_failed"


class AnswerTooLarge(InvalidRequest):
    """A request whose answer could exceed the per-answer budget (--max-answer-tokens)."""

    code = "response_too_large"


class UnreadableBody(InvalidRequest):
    """The request body does not decode (its Content-Encoding): the rest of the connection
    cannot be trusted either, so it is closed after the 400."""

    closes = True


class RequestTimeout(ProxyError):
    """The request body did not arrive within --body-timeout (a client trickling it)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    closes = True


class ClientGone(ProxyError):
    """The client closed its connection before its request body had arrived (nginx's 499:
    logged and counted as such, never as a server error; nobody reads the answer)."""

    status = 499
    type = "invalid_request_error"
    code = "client_disconnected"
    closes = True


class Overloaded(ProxyError):
    """The generation queue is full."""

    status = 503
    type = "server_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class StoreDown(ProxyError):
    """A store operation the request needs (admin API, a replayed answer) failed."""

    status = 503
    type = "server_error"
    code = "store_unavailable"


class GenerationTimeout(ProxyError):
    """A generation ran past the per-request timeout."""

    status = 504
    type = "server_error"
    code = "generation_timeout"


class NotCached(ProxyError):
    """only-if-cached asked for a stored answer and there is none (RFC 9111: 504)."""

    status = 504
    type = "invalid_request_error"
    code = "not_cached"


class NotRecorded(ProxyError):
    """A replaying server has no recorded answer for this request (it never generates)."""

    status = 404
    type = "invalid_request_error"
    code = "not_recorded"

    def __init__(self, message: str, *, request: dict[str, object]) -> None:
        super().__init__(message)
        self.request = request
        self.cache_log = {"cache": CacheStatus.MISS.value, "reason": Reason.NOT_RECORDED.value}

    def body(self) -> dict[str, object]:
        """The OpenAI error object, with the canonical request that was not found."""
        body = super().body()
        error = body["error"]
        if isinstance(error, dict):
            error["request"] = self.request
        return body

    def headers(self) -> dict[str, str]:
        return {"X-Cache": f"{CacheStatus.MISS}; reason={Reason.NOT_RECORDED}"}


class GenerationFailed(ProxyError):
    """The runner failed while generating."""

    status = 500
    type = "server_error"
    code = "generation_failed"


class UpstreamUnavailable(ProxyError):
    """The upstream server (mlx_lm.server) cannot be reached or broke off its answer."""

    status = 502
    type = "server_error"
    code = "upstream_unavailable"


class SchemaViolated(ProxyError):
    """An answer the upstream generated does not hold to the schema its request asked for
    (upstream mode checks it: nothing there constrains decoding); it is not stored."""

    status = 502
    type = "server_error"
    code = "schema_violated"


class UpstreamTimeout(GenerationTimeout):
    """The upstream server went silent for longer than the upstream timeout."""

    code = "upstream_timeout"
