"""The wire of mlx_lm.server: the body a canonical request becomes, the events of its stream
and how they become chunks, its `system_fingerprint`, its errors. No I/O here.

Facts of mlx_lm.server (0.32) this module is written against:
- every parameter the body leaves out falls back to the server's CLI defaults (`--temp`,
  `--top-p`, `--max-tokens`, ...), so the body sets every one of them;
- a request with a `seed` is served alone (never batched with other requests);
- `model` names what to load: "default_model" is the model given to `--model`, any other
  name makes the server load (or download) that path;
- its stop words match token sequences, and the stop text is stripped wherever it shows up
  in the output, even when the tokens did not match and generation goes on; so the proxy
  sends no stop words and cuts the text itself, the OpenAI way (see `Assembler`);
- a stream carries no token ids and no logprobs (only whole responses do).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any, NamedTuple

import orjson

from cacheproxy.errors import ProxyError, UpstreamUnavailable
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.codec import Chunk, ToolCallOut
from cacheproxy.runners.assembler import Assembler
from cacheproxy.runners.base import Generation
from cacheproxy.runners.chat import template_inputs
from policies.sampling import Sampling

SERVED_MODEL = "default_model"
PINNED_SEED = 0
"""The seed sent when a request has none: a seeded request is generated alone upstream."""
PENALTY_CONTEXT = 20  # tokens the penalties look back over: mlx-lm's own default


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What an upstream's `system_fingerprint` pins: versions, and the device when scoped."""

    engine_version: str
    mlx_version: str
    device: str
    raw: str = field(compare=False)


def parse_system_fingerprint(raw: str, *, device_scope: bool) -> EngineIdentity:
    """mlx_lm.server builds it as f"{mlx_lm version}-{mlx version}-{platform}-{arch}".

    PEP 440 versions hold no "-", so the first two fields split cleanly; the platform
    (kernel, libc, arch) only counts with device scope, like the in-process runner's device.
    A string of another shape is pinned whole, as the engine version.
    """
    parts = raw.split("-", 2)
    if len(parts) < 3 or not all(parts):
        return EngineIdentity(raw, "", "", raw)
    return EngineIdentity(parts[0], parts[1], parts[2] if device_scope else "", raw)


def _seed(s: Sampling) -> dict[str, int]:
    """Greedy: the pinned seed (served alone); seeded: its seed; unseeded sampling (a BYPASS
    the client wants random): no seed, so the answer stays a random draw."""
    if s.seed is not None:
        return {"seed": s.seed % 2**64}
    return {"seed": PINNED_SEED} if s.is_greedy else {}


def request_body(request: CanonicalRequest) -> dict[str, Any]:
    """The streamed request for a canonical one: every sampling parameter explicit."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "repetition_penalty": request.repetition_penalty,
        "repetition_context_size": PENALTY_CONTEXT,
        "presence_penalty": request.presence_penalty,
        "presence_context_size": PENALTY_CONTEXT,
        "frequency_penalty": request.frequency_penalty,
        "frequency_context_size": PENALTY_CONTEXT,
        "xtc_probability": 0.0,
        "xtc_threshold": 0.0,
        "logit_bias": {str(token): bias for token, bias in request.logit_bias},
        **_seed(s),
        "logprobs": False,
        "top_logprobs": 0,
        "stop": [],  # applied by the proxy on the text: see the module docstring
    }
    if request.endpoint == "chat":
        # As the in-process runner renders them; mlx_lm.server takes tool-call arguments as
        # objects (or strings it decodes), and merges the kwargs over its own.
        messages, tools, kwargs = template_inputs(request)
        body["messages"] = messages
        if tools:
            body["tools"] = tools
        body["chat_template_kwargs"] = kwargs
    else:
        body["prompt"] = request.prompt
    return body


def probe_body() -> bytes:
    """A one-token request whose only purpose is the response's `system_fingerprint`."""
    return orjson.dumps({"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 1,
                         "temperature": 0.0, "seed": PINNED_SEED, "stream": False})


def path(request: CanonicalRequest) -> str:
    """The upstream endpoint of a canonical request."""
    return "/v1/chat/completions" if request.endpoint == "chat" else "/v1/completions"


DONE = object()
"""The `data: [DONE]` line that ends a stream."""


def parse_line(line: bytes) -> dict[str, Any] | object | None:
    """One SSE line: an event (dict), DONE, or None for blank lines, comments, keepalives."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return DONE
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamUnavailable(f"the upstream sent a malformed event: {exc}") from None
    if not isinstance(event, dict):
        raise UpstreamUnavailable("the upstream sent an event that is not an object")
    return event


class Delta(NamedTuple):
    """What one stream event carries (a tuple: one is built per token)."""

    text: str
    finish_reason: str | None
    usage: tuple[int, int] | None  # (prompt, completion) tokens, on the last event
    fingerprint: str
    reasoning: str = ""
    calls: tuple[tuple[str, str], ...] = ()  # (name, arguments): mlx_lm.server's ids dropped


def delta(event: dict[str, Any]) -> Delta:
    """Text, finish reason, usage and system_fingerprint of a chat or text stream event,
    and a chat event's reasoning and tool calls."""
    text, finish, reasoning = "", None, ""
    calls: tuple[tuple[str, str], ...] = ()
    choices = event.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        message = choice.get("delta")
        if isinstance(message, dict):
            text = message.get("content") or ""
            reasoning = str(message.get("reasoning") or "")
            calls = _calls(message.get("tool_calls"))
        else:
            text = choice.get("text") or ""
        finish = choice.get("finish_reason")
    usage = event.get("usage")
    counts = None
    if isinstance(usage, dict):
        # prompt_tokens_details.cached_tokens is ignored: it depends on the upstream's
        # prompt cache, not on the answer.
        counts = (int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
    return Delta(str(text), finish if isinstance(finish, str) else None, counts,
                 str(event.get("system_fingerprint", "")), reasoning, calls)


def _calls(raw: object) -> tuple[tuple[str, str], ...]:
    """mlx_lm.server sends each call whole, in one delta, with a random id (not kept)."""
    if not raw:
        return ()
    if not isinstance(raw, list):
        raise UpstreamUnavailable("the upstream sent tool_calls that are not a list")
    out = []
    for call in raw:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise UpstreamUnavailable("the upstream sent a tool call without a function name")
        arguments = function.get("arguments", "{}")
        out.append((function["name"], arguments if isinstance(arguments, str)
                    else orjson.dumps(arguments).decode()))
    return tuple(out)


def _is_object(arguments: str) -> bool:
    """Whether a call's arguments are a JSON object (a tool's input is one)."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class UpstreamRejected(ProxyError):
    """The upstream refused the request (4xx): its status and message are passed through."""

    type = "invalid_request_error"
    code = "upstream_rejected"


@cache
def _rejected(status: int) -> type[UpstreamRejected]:
    return type(f"UpstreamRejected{status}", (UpstreamRejected,), {"status": status})


def error_message(body: bytes) -> str:
    """The message of an mlx_lm.server error body ({"error": "..."}), or the raw text."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace").strip()[:500] or "(empty body)"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    return str(error if error is not None else data)[:500]


def rejection(status: int, body: bytes) -> ProxyError:
    """An upstream error status as a proxy error: 4xx passed through, anything else 502."""
    message = error_message(body)
    if 400 <= status < 500:
        return _rejected(status)(f"upstream: {message}")
    return UpstreamUnavailable(f"the upstream answered {status}: {message}")


class Reading:
    """One upstream stream as it is relayed: OpenAI stops applied to the answer text,
    reasoning and tool calls passed on, chunks published."""

    def __init__(self, generation: Generation, request: CanonicalRequest,
                 call_markers: tuple[str, str] = ("", "")) -> None:
        self._generation = generation
        self._markers = call_markers
        # Without stop strings every delta is relayed as it is (the common case, per token).
        self._assembler = Assembler(request.stop) if request.stop else None
        self._offered = bool(request.tools)
        self._one_call = self._offered and not request.parallel_tool_calls
        self.chunks: list[Chunk] = []
        self.calls = 0
        self.deltas = 0
        self.finish = ""
        self.usage: tuple[int, int] | None = None
        self.cut = False  # the proxy ended the answer: a stop string, or its one tool call

    @property
    def may_cut(self) -> bool:
        """Whether the proxy may end this answer before the upstream does."""
        return self._assembler is not None or self._one_call

    def take(self, d: Delta) -> bool:
        """Relay one event; True when the proxy ends the answer here."""
        if d.calls:
            # mlx_lm.server parses a call whether tools were offered or not, and whatever its
            # arguments; the in-process runner keeps such text (no tools, arguments that are
            # no JSON object) as text, so the call is written back as text in the template's
            # call markup (mlx_lm.server re-serialized its arguments).
            texts = [c for c in d.calls if not self._offered or not _is_object(c[1])]
            if texts:
                d = d._replace(text=d.text + "".join(self._as_text(n, a) for n, a in texts),
                               calls=tuple(c for c in d.calls if c not in texts))
        if d.text or d.reasoning or d.calls:
            self.deltas += 1
        if d.reasoning:
            self._publish(Chunk("", (), reasoning=d.reasoning))
        if d.text:
            if self._assembler is None:
                self._publish(Chunk(d.text, ()))
            else:
                self._publish(self._assembler.add(0, d.text, None))
                if self._assembler.stopped:
                    self.finish, self.cut = "stop", True
                    return True
        if d.calls:
            calls = tuple(ToolCallOut(self.calls + i, name, arguments)
                          for i, (name, arguments) in enumerate(d.calls))
            calls = calls[:1] if self._one_call else calls
            self.calls += len(calls)
            self._publish(Chunk("", (), tool_calls=calls))
            if self._one_call:  # parallel_tool_calls false: the one call is made
                self.finish, self.cut = "tool_calls", True
                return True
        self.finish = d.finish_reason or self.finish
        if self.finish == "tool_calls" and not self.calls:
            self.finish = "stop"  # (the call is text)
        self.usage = d.usage or self.usage
        return False

    def _as_text(self, name: str, arguments: str) -> str:
        start, end = self._markers
        try:
            value: Any = json.loads(arguments)
        except ValueError:
            value = arguments
        call = json.dumps({"name": name, "arguments": value}, ensure_ascii=False)
        return f"{start}\n{call}\n{end}"

    @property
    def matched(self) -> str:
        """The stop sequence the proxy cut the answer at ("": none)."""
        return self._assembler.matched if self._assembler is not None else ""

    def flush(self) -> None:
        """Publish the text held back for a possible stop string."""
        if self._assembler is not None and not self._assembler.stopped:
            self._publish(self._assembler.finish(""))

    def _publish(self, chunk: Chunk | None) -> None:
        # An upstream stream carries no token ids (the Assembler's are placeholders).
        if chunk is not None and (chunk.text or chunk.reasoning or chunk.tool_calls):
            if chunk.tokens:
                chunk = Chunk(chunk.text, (), (), chunk.reasoning, chunk.tool_calls)
            self.chunks.append(chunk)
            self._generation.put(chunk)
