"""Request body -> CanonicalRequest: aliases merged, runner defaults filled, numbers normalized.

The canonical request is exactly what is hashed into the key and exactly what the
runner generates from. Delivery options (stream, include_usage, n) live beside it in
`Delivery` because they change how an answer is sent, never what it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from cacheproxy.errors import InvalidRequest, ModelNotFound, Unsupported
from cacheproxy.keys import fields
from policies.sampling import Sampling, SamplingMode, SamplingOutcome, resolve_sampling

Endpoint = Literal["chat", "completions"]
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True, slots=True)
class Message:
    """One chat turn, content flattened to text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class RunnerDefaults:
    """What the runner fills in for every parameter a request leaves out."""

    model_id: str
    aliases: frozenset[str]
    max_tokens: int
    max_tokens_cap: int
    context_length: int
    vocab_size: int | None = None  # None: unknown, token ids are checked by the runner


@dataclass(frozen=True, slots=True)
class CanonicalRequest:
    """Everything that can change the generated answer, and nothing else."""

    endpoint: Endpoint
    model: str
    messages: tuple[Message, ...]
    prompt: str
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    logprobs: bool
    top_logprobs: int
    packed: bytes = field(init=False, repr=False, compare=False)
    """msgpack of `wire()`, computed once: the key hashes it, a hit compares it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "packed", msgpack.packb(self.wire(), use_bin_type=True))

    def wire(self) -> dict[str, Any]:
        """Plain-data form (msgpack-able), used for the key and stored in the record."""
        s = self.sampling
        return {
            "endpoint": self.endpoint,
            "model": self.model,
            "messages": [{"role": m.role, "content": m.content} for m in self.messages],
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                         "min_p": s.min_p, "seed": s.seed},
            "stop": list(self.stop),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": [list(b) for b in self.logit_bias],
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CanonicalRequest:
        """Inverse of `wire` (for replaying stored requests)."""
        messages = tuple(Message(**m) for m in data["messages"])
        bias = tuple((int(t), float(b)) for t, b in data["logit_bias"])
        return cls(**{**data, "messages": messages, "sampling": Sampling(**data["sampling"]),
                      "stop": tuple(data["stop"]), "logit_bias": bias})


@dataclass(frozen=True, slots=True)
class Delivery:
    """How the answer is sent back; not part of the key."""

    stream: bool
    include_usage: bool
    n: int
    requested_model: str


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request: the canonical request, its delivery, the sampling outcome."""

    request: CanonicalRequest
    delivery: Delivery
    sampling: SamplingOutcome


def _text_content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise Unsupported(f"'{where}' supports only text parts", param=where)
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"'{where}' text parts need a string 'text'", param=where)
            parts.append(text)
        return "".join(parts)
    raise InvalidRequest(f"'{where}' must be a string or a list of text parts", param=where)


def _messages(body: Mapping[str, Any]) -> tuple[Message, ...]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        role = ROLES.get(r) if isinstance(r := m.get("role"), str) else None
        if role is None:
            raise InvalidRequest(
                f"'{where}.role' must be one of {sorted(ROLES)}", param=f"{where}.role"
            )
        out.append(Message(role, _text_content(m.get("content"), f"{where}.content")))
    return tuple(out)


def _prompt(body: Mapping[str, Any]) -> str:
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if not isinstance(raw, str):
        raise InvalidRequest("'prompt' must be a string", param="prompt")
    if raw == "":
        raise InvalidRequest("'prompt' must not be empty", param="prompt")
    return raw


def _logit_bias(body: Mapping[str, Any], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    raw = fields.obj(body, "logit_bias")
    bias = []
    for token in raw:
        if not (token.isascii() and token.isdigit()):
            raise InvalidRequest("'logit_bias' keys must be token ids", param="logit_bias")
        value = raw[token]
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or not -100 <= value <= 100:
            raise InvalidRequest("'logit_bias' values must be numbers in [-100, 100]",
                                 param="logit_bias")
        if vocab_size is not None and int(token) >= vocab_size:
            raise InvalidRequest(f"'logit_bias' token {token} is not in the vocabulary",
                                 param="logit_bias")
        bias.append((int(token), float(value) + 0.0))
    return tuple(sorted(bias))


def _logprobs(body: Mapping[str, Any], endpoint: Endpoint) -> tuple[bool, int]:
    if endpoint == "chat":
        wanted = fields.boolean(body, "logprobs", False)
        top = fields.integer(body, "top_logprobs", 0, lo=0, hi=20) or 0
        return wanted, top if wanted else 0
    top_or_none = fields.integer(body, "logprobs", None, lo=0, hi=5)
    return top_or_none is not None, top_or_none or 0


def _reject_unsupported(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    for name in ("tools", "functions"):
        fields.reject_if_set(body, name, "this proxy serves plain text generation")
    # The explicit defaults some SDKs send are harmless; anything else is refused.
    if body.get("tool_choice") not in (None, "none"):
        fields.reject_if_set(body, "tool_choice", "this proxy serves plain text generation")
    if body.get("response_format") not in (None, {"type": "text"}):
        fields.reject_if_set(body, "response_format", "only plain text output is supported")
    if endpoint == "completions":
        fields.reject_if_set(body, "suffix", "the runner does not do fill-in-the-middle")
        fields.reject_if_set(body, "echo", "the prompt is not echoed")
        best_of = fields.integer(body, "best_of", 1, lo=1, hi=1)
        del best_of


def parse(
    body: object, endpoint: Endpoint, defaults: RunnerDefaults, mode: SamplingMode,
    *, max_tokens_cap: int | None = None,
) -> Parsed:
    """Validate a decoded JSON body and build its canonical request."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _reject_unsupported(body, endpoint)
    model = fields.string(body, "model", defaults.model_id)
    if model != defaults.model_id and model not in defaults.aliases:
        raise ModelNotFound(f"The model '{model}' does not exist", param="model")
    cap = min(defaults.max_tokens_cap, defaults.context_length, max_tokens_cap or 2**31)
    alias = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    max_tokens = fields.integer(body, alias or "max_tokens", defaults.max_tokens, lo=1, hi=cap)
    stream = fields.boolean(body, "stream", False)
    options = fields.obj(body, "stream_options")
    requested = Sampling(
        temperature=fields.number(body, "temperature", 0.0, lo=0.0, hi=2.0),
        top_p=fields.number(body, "top_p", 1.0, lo=0.0, hi=1.0),
        top_k=fields.integer(body, "top_k", 0, lo=0, hi=1_000_000) or 0,
        min_p=fields.number(body, "min_p", 0.0, lo=0.0, hi=1.0),
        seed=fields.integer(body, "seed", None, lo=-(2**63), hi=2**64 - 1),
    )
    outcome = resolve_sampling(requested, mode)
    n = fields.integer(body, "n", 1, lo=1, hi=16) or 1
    if n > 1 and not outcome.sampling.is_greedy:
        raise Unsupported("'n' > 1 needs greedy decoding (temperature 0)", param="n")
    logprobs, top_logprobs = _logprobs(body, endpoint)
    request = CanonicalRequest(
        endpoint=endpoint,
        model=defaults.model_id,
        messages=_messages(body) if endpoint == "chat" else (),
        prompt=_prompt(body) if endpoint == "completions" else "",
        max_tokens=max_tokens or defaults.max_tokens,
        sampling=outcome.sampling,
        stop=fields.stop_list(body),
        presence_penalty=fields.number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=fields.number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=fields.number(body, "repetition_penalty", 1.0, lo=0.01, hi=10.0),
        logit_bias=_logit_bias(body, defaults.vocab_size),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    delivery = Delivery(
        stream=stream,
        include_usage=stream and fields.boolean(options, "include_usage", False),
        n=n,
        requested_model=model,
    )
    return Parsed(request, delivery, outcome)
