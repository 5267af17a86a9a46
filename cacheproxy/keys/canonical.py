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

from cacheproxy.errors import AnswerTooLarge, InvalidRequest, ModelNotFound, Unsupported
from cacheproxy.keys import fields, grammar
from cacheproxy.keys import tools as tooling
from cacheproxy.keys.messages import ROLES, Message, messages
from cacheproxy.keys.tools import Tool
from policies.sampling import Sampling, SamplingMode, SamplingOutcome, resolve_sampling

Endpoint = Literal["chat", "completions"]
"""What the canonical request is: a chat or a text completion."""
Route = Literal["chat", "completions", "responses", "messages"]
"""Which API a request came through (and is answered in): Responses and Messages ask for chats."""
__all__ = ["ROLES", "CanonicalRequest", "Delivery", "Endpoint", "Message", "Parsed", "Route",
           "RunnerDefaults", "parse"]


@dataclass(frozen=True, slots=True)
class RunnerDefaults:
    """What the runner fills in for every parameter a request leaves out."""

    model_id: str
    aliases: frozenset[str]
    max_tokens: int
    max_tokens_cap: int
    context_length: int
    vocab_size: int | None = None  # None: unknown, token ids are checked by the runner
    # What the chat template gets when a request sets no chat_template_kwargs (mlx-lm's
    # own default: enable_thinking, true when the model has a thinking marker), and the name
    # the template knows the switch by (mlx-lm renames enable_thinking for some templates).
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    thinking_kwarg: str = "enable_thinking"
    tool_calling: bool = False  # mlx-lm knows how to parse this model's tool calls
    tool_format: str = ""  # mlx-lm's tool parser for it ("json_tools": JSON calls)
    grammar_engine: str = ""  # what constrains decoding ("": nothing can, as upstream)
    # Without a grammar engine, whether the runner checks a structured answer against its
    # schema instead (upstream mode: a violating answer is an error, never stored).
    validates_schemas: bool = False


@dataclass(frozen=True, slots=True)
class CanonicalRequest:
    """Everything that can change the generated answer, and nothing else."""

    endpoint: Endpoint
    # The served model's name, for the response: not in `wire()` (nor the key), since the
    # answer depends on the files (the fingerprint), never on what they are called.
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
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"  # "auto", "none", "required", or "function" (tool_name)
    tool_name: str = ""
    parallel_tool_calls: bool = True
    template_kwargs: str = "{}"  # canonical JSON object: chat_template_kwargs over defaults
    response_format: str = ""  # canonical JSON of a non-text response_format (keys.grammar)
    packed: bytes = field(init=False, repr=False, compare=False)
    """msgpack of `wire()`, computed once: the key hashes it, a hit compares it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "packed", msgpack.packb(self.wire(), use_bin_type=True))

    def wire(self) -> dict[str, Any]:
        """Plain-data form (msgpack-able), used for the key and stored in the record."""
        s = self.sampling
        return {
            "endpoint": self.endpoint,
            "messages": [m.wire() for m in self.messages],
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
            "tools": [[t.name, t.description, t.parameters, t.strict] for t in self.tools],
            "tool_choice": self.tool_choice,
            "tool_name": self.tool_name,
            "parallel_tool_calls": self.parallel_tool_calls,
            "template_kwargs": self.template_kwargs,
            "response_format": self.response_format,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], model: str = "") -> CanonicalRequest:
        """Inverse of `wire` (for replaying stored requests), under the served `model` name
        (records stored before names left the key carry one: ignored)."""
        data = {k: v for k, v in data.items() if k != "model"}
        messages = tuple(Message.from_wire(m) for m in data["messages"])
        bias = tuple((int(t), float(b)) for t, b in data["logit_bias"])
        offered = tuple(Tool(*t) for t in data.get("tools", ()))
        return cls(**{**data, "model": model, "messages": messages,
                      "sampling": Sampling(**data["sampling"]),
                      "stop": tuple(data["stop"]), "logit_bias": bias, "tools": offered})


@dataclass(frozen=True, slots=True)
class Delivery:
    """How the answer is sent back; not part of the key."""

    stream: bool
    include_usage: bool
    n: int
    requested_model: str
    legacy_functions: bool = False  # asked with `functions`: answered with `function_call`
    api: Route = "chat"  # the API the answer is rendered for
    echo: bytes = b""  # JSON of what a Responses object repeats of its request


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request: the canonical request, its delivery, the sampling outcome."""

    request: CanonicalRequest
    delivery: Delivery
    sampling: SamplingOutcome
    # For a structured request (response_format, strict tools), how its schema holds:
    # "enforced" by constrained decoding, or "validated" after the fact (upstream mode).
    schema_guarantee: str = ""


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
        # One spelling per token id ("5", never "05"): two spellings would be two keys.
        if not (token.isascii() and token.isdigit()) or token != str(int(token)):
            raise InvalidRequest("'logit_bias' keys must be token ids in decimal without "
                                 "leading zeros", param="logit_bias")
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


# Every field a request may carry: one the parser applies or keys, one it refuses by name, or
# one that changes nothing in the answer (passed: never keyed). Any other is a 400 naming it:
# a parameter is never dropped without a word (mlx_lm.server's own extras, such as
# `repetition_context_size` or `xtc_probability`, would change the answer).
PASSED = frozenset({"user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                    "prompt_cache_retention", "prompt_cache_options", "prediction", "store"})
_COMMON = frozenset({"model", "max_tokens", "stream", "stream_options", "temperature", "top_p",
                     "top_k", "min_p", "seed", "n", "logprobs", "stop", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "logit_bias"})
_KNOWN: dict[str, frozenset[str]] = {
    "chat": _COMMON | PASSED | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "function_call", "chat_template_kwargs",
        "reasoning_effort", "response_format", "audio", "web_search_options", "verbosity",
        "modalities"},
    "completions": _COMMON | PASSED | {
        "prompt", "best_of", "echo", "suffix", "tools", "functions", "tool_choice",
        "function_call", "parallel_tool_calls", "chat_template_kwargs", "response_format"},
}


def _reject_unsupported(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    for name in body:
        if name not in _KNOWN[endpoint]:
            other = "completions" if endpoint == "chat" else "chat"
            if name in _KNOWN[other]:
                where = "/v1/completions" if other == "completions" else "/v1/chat/completions"
                raise Unsupported(f"'{name}' belongs to {where}, not this endpoint", param=name)
            raise Unsupported(f"'{name}' is not a parameter this server knows: it is refused "
                              "rather than ignored (it might change the answer)", param=name)
    if body.get("store") not in (None, False):
        raise Unsupported("'store' true is not supported: this server keeps no completions "
                          "to retrieve (every answer is cached by its request anyway)",
                          param="store")
    if endpoint == "completions":
        for name in ("tools", "functions", "tool_choice", "function_call",
                     "parallel_tool_calls", "chat_template_kwargs", "response_format"):
            fields.reject_if_set(body, name, "it belongs to chat completions")
        fields.reject_if_set(body, "suffix", "the runner does not do fill-in-the-middle")
        fields.reject_if_set(body, "echo", "the prompt is not echoed")
        best_of = fields.integer(body, "best_of", 1, lo=1, hi=1)
        del best_of
        return
    # OpenAI parameters that would change the answer and that a text model cannot honour.
    fields.reject_if_set(body, "audio", "the model answers in text only")
    fields.reject_if_set(body, "web_search_options", "this server runs no web search")
    fields.reject_if_set(body, "verbosity", "no chat template takes it (ask in the prompt)")
    if body.get("modalities") not in (None, ["text"]):
        raise Unsupported("'modalities' other than [\"text\"] is not supported: the model "
                          "answers in text only", param="modalities")


def _chat(body: Mapping[str, Any], defaults: RunnerDefaults) -> tuple[dict[str, Any], bool]:
    """The chat fields of the canonical request, and whether tools came as `functions`.

    Under tool_choice "none" the template is rendered without the tools (the model is
    never offered them), so they leave the key; so does parallel_tool_calls without tools.
    """
    offered, legacy = tooling.tools(body)
    choice, name = tooling.tool_choice(body, offered, legacy)
    parallel = fields.boolean(body, "parallel_tool_calls", not legacy)
    if legacy and parallel:
        raise InvalidRequest("the legacy 'functions' make one call at most",
                             param="parallel_tool_calls")
    if choice == "none":
        offered, parallel = (), True
    if offered and not defaults.tool_calling:
        raise Unsupported("this model's chat template has no tool-call format mlx-lm can "
                          "parse, so tool calls could not be told from text",
                          param="functions" if legacy else "tools")
    chat = {"messages": messages(body), "tools": offered, "tool_choice": choice,
            "tool_name": name, "parallel_tool_calls": parallel,
            "template_kwargs": tooling.template_kwargs(body, defaults.template_kwargs,
                                                      defaults.thinking_kwarg),
            "response_format": _structured(body, offered, defaults)}
    return chat, legacy


def _structured(body: Mapping[str, Any], offered: tuple[Tool, ...],
                defaults: RunnerDefaults) -> str:
    """The canonical response_format, once strict tools and the format are known to be
    enforceable by this runner."""
    form = grammar.response_format(body)
    strict = any(t.strict for t in offered)
    if (form or strict) and not (defaults.grammar_engine or defaults.validates_schemas):
        param = "response_format" if form else "tools"
        raise Unsupported("this runner can neither constrain decoding nor check answers, so "
                          "it cannot guarantee the schema", param=param)
    if form and offered:
        raise Unsupported("'response_format' together with tools is not supported: the answer "
                          "would have to be either a call or the format", param="response_format")
    if strict:
        # (Validated answers take any call format mlx-lm parses: only a grammar needs JSON.)
        if defaults.grammar_engine and defaults.tool_format != "json_tools":
            raise Unsupported("strict tools need a model whose tool calls are JSON objects "
                              f"(mlx-lm's json_tools format; this one: {defaults.tool_format})",
                              param="tools")
        grammar.check_strict(offered)
    return form


def _sampling(body: Mapping[str, Any], mode: SamplingMode) -> SamplingOutcome:
    requested = Sampling(
        temperature=fields.number(body, "temperature", 0.0, lo=0.0, hi=2.0),
        top_p=fields.number(body, "top_p", 1.0, lo=0.0, hi=1.0),
        top_k=fields.integer(body, "top_k", 0, lo=0, hi=1_000_000) or 0,
        min_p=fields.number(body, "min_p", 0.0, lo=0.0, hi=1.0),
        seed=fields.integer(body, "seed", None, lo=-(2**63), hi=2**64 - 1),
    )
    return resolve_sampling(requested, mode)


def parse(
    body: object, endpoint: Endpoint, defaults: RunnerDefaults, mode: SamplingMode,
    *, max_tokens_cap: int | None = None, max_answer_tokens: int | None = None,
    max_stops: int = fields.MAX_STOPS,
) -> Parsed:
    """Validate a decoded JSON body and build its canonical request; `max_answer_tokens`
    bounds what one answer may hold (choices x tokens x (1 + logprob alternatives)),
    `max_stops` its stop sequences (an API translated to chat may take more than OpenAI)."""
    try:
        return _parse(body, endpoint, defaults, mode, max_tokens_cap, max_answer_tokens,
                      max_stops)
    except RecursionError:  # a schema or kwargs nested hundreds deep: walked recursively
        raise InvalidRequest("the request nests JSON too deeply to be read") from None


def _parse(body: object, endpoint: Endpoint, defaults: RunnerDefaults, mode: SamplingMode,
           max_tokens_cap: int | None, max_answer_tokens: int | None,
           max_stops: int = fields.MAX_STOPS) -> Parsed:
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
    options = fields.stream_options(body, frozenset({"include_usage"}))
    outcome = _sampling(body, mode)
    n = fields.integer(body, "n", 1, lo=1, hi=16) or 1
    if n > 1 and not outcome.sampling.is_greedy:
        raise Unsupported("'n' > 1 needs greedy decoding (temperature 0)", param="n")
    logprobs, top_logprobs = _logprobs(body, endpoint)
    fan_out = n * (max_tokens or defaults.max_tokens) * (1 + top_logprobs if logprobs else 1)
    if max_answer_tokens is not None and fan_out > max_answer_tokens:
        raise AnswerTooLarge(
            f"the answer could hold {fan_out} token entries (n={n} x max_tokens="
            f"{max_tokens or defaults.max_tokens} x {1 + top_logprobs if logprobs else 1} per "
            f"token with logprobs), over this server's limit of {max_answer_tokens}: lower "
            "n, max_tokens or top_logprobs", param="max_tokens")
    chat, legacy = _chat(body, defaults) if endpoint == "chat" else ({}, False)
    request = CanonicalRequest(
        endpoint=endpoint,
        model=defaults.model_id,
        messages=chat.pop("messages", ()),
        prompt=_prompt(body) if endpoint == "completions" else "",
        max_tokens=max_tokens or defaults.max_tokens,
        sampling=outcome.sampling,
        stop=fields.stop_list(body, most=max_stops),
        presence_penalty=fields.number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=fields.number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=fields.number(body, "repetition_penalty", 1.0, lo=0.01, hi=10.0),
        logit_bias=_logit_bias(body, defaults.vocab_size),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        **chat,
    )
    delivery = Delivery(
        stream=stream,
        include_usage=stream and fields.boolean(options, "include_usage", False),
        n=n,
        requested_model=model,
        legacy_functions=legacy,
        api=endpoint,
    )
    structured = request.response_format or any(t.strict for t in request.tools)
    guarantee = ("enforced" if defaults.grammar_engine else "validated") if structured else ""
    return Parsed(request, delivery, outcome, guarantee)
