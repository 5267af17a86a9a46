"""Request validation: every bad input raises the right error naming the right field."""

from __future__ import annotations

from typing import Any

import msgpack
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheproxy.errors import (
    AnswerTooLarge,
    InvalidRequest,
    ModelNotFound,
    ProxyError,
    Unsupported,
)
from cacheproxy.keys.canonical import (
    CanonicalRequest,
    Delivery,
    Endpoint,
    Message,
    RunnerDefaults,
    parse,
)
from policies.sampling import GREEDY, Sampling, SamplingMode

DEFAULTS = RunnerDefaults(
    model_id="demo",
    aliases=frozenset({"/path/demo"}),
    max_tokens=256,
    max_tokens_cap=4096,
    context_length=512,
)
SEEDED = SamplingMode.SEEDED
GREEDY_MODE = SamplingMode.FORCE_GREEDY
MESSAGES = [{"role": "user", "content": "Hello"}]
CHAT: dict[str, Any] = {"messages": MESSAGES}
COMPLETION: dict[str, Any] = {"prompt": "Once upon"}


def rejects(
    body: object,
    error: type[ProxyError],
    param: str | None,
    *,
    endpoint: Endpoint = "chat",
    mode: SamplingMode = SEEDED,
) -> None:
    """`parse` raises exactly `error` with `.param == param`."""
    with pytest.raises(ProxyError) as info:
        parse(body, endpoint, DEFAULTS, mode)
    assert type(info.value) is error, info.value
    assert info.value.param == param, info.value


# Fields read by the shared typed readers, and the kind of value each one takes.
NUMBERS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
INTEGERS = ["max_tokens", "max_completion_tokens", "top_k", "seed", "n", "top_logprobs"]
BOOLEANS = ["stream", "logprobs"]
NOT_A_NUMBER: list[Any] = ["1", True, False, [1], {"v": 1}]
NOT_AN_INTEGER: list[Any] = [*NOT_A_NUMBER, 1.5, 0.1]
NOT_A_BOOLEAN: list[Any] = [1, 0, "true", [True], {"v": True}]


@pytest.mark.parametrize("value", NOT_A_NUMBER, ids=repr)
@pytest.mark.parametrize("field", NUMBERS)
def test_number_fields_reject_wrong_types(field: str, value: Any) -> None:
    rejects({**CHAT, field: value}, InvalidRequest, field)


@pytest.mark.parametrize("value", NOT_AN_INTEGER, ids=repr)
@pytest.mark.parametrize("field", INTEGERS)
def test_integer_fields_reject_wrong_types(field: str, value: Any) -> None:
    rejects({**CHAT, field: value}, InvalidRequest, field)


@pytest.mark.parametrize("value", NOT_A_BOOLEAN, ids=repr)
@pytest.mark.parametrize("field", BOOLEANS)
def test_boolean_fields_reject_wrong_types(field: str, value: Any) -> None:
    rejects({**CHAT, field: value}, InvalidRequest, field)


@pytest.mark.parametrize("value", [*NOT_AN_INTEGER, -1, 6])
def test_completions_logprobs_is_an_integer_up_to_5(value: Any) -> None:
    rejects({**COMPLETION, "logprobs": value}, InvalidRequest, "logprobs", endpoint="completions")


@pytest.mark.parametrize("value", ["yes", 1, [], [{"include_usage": True}]], ids=repr)
def test_stream_options_must_be_an_object(value: Any) -> None:
    rejects({**CHAT, "stream": True, "stream_options": value}, InvalidRequest, "stream_options")


@pytest.mark.parametrize("options", [{"include_usage": True, "chunk_size": 4},
                                     {"include_obfuscation": True}], ids=repr)
def test_stream_options_the_server_does_not_apply_are_refused(options: dict[str, Any]) -> None:
    name = next(k for k in options if k != "include_usage")
    rejects({**CHAT, "stream": True, "stream_options": options}, Unsupported,
            f"stream_options.{name}")


def test_include_obfuscation_false_is_what_the_server_does() -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_obfuscation": False}}
    assert parse(body, "chat", DEFAULTS, SEEDED).delivery.stream


@pytest.mark.parametrize("value", NOT_A_BOOLEAN, ids=repr)
def test_include_usage_must_be_a_boolean(value: Any) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": value}}
    with pytest.raises(InvalidRequest) as info:
        parse(body, "chat", DEFAULTS, SEEDED)
    assert info.value.param in {"include_usage", "stream_options.include_usage"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.0001),
        ("top_p", -0.5),
        ("top_p", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("top_k", -1),
        ("top_k", 1_000_001),
        ("seed", -(2**63) - 1),
        ("seed", 2**64),
        ("n", 0),
        ("n", 17),
        ("presence_penalty", -2.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", 2.01),
        ("repetition_penalty", 0),
        ("repetition_penalty", 10.5),
        ("top_logprobs", -1),
        ("top_logprobs", 21),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_completion_tokens", 0),
    ],
)
def test_out_of_range_values(field: str, value: float) -> None:
    rejects({**CHAT, field: value}, InvalidRequest, field)


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("temperature", "1e308"),
        ("temperature", "-1e308"),
        ("top_p", "1e300"),
        ("presence_penalty", "123456789012345678901234567890"),
        ("max_tokens", "1e308"),
        ("max_tokens", "18446744073709551615"),
        ("max_completion_tokens", "99999999999999999999"),
        ("top_k", "1e20"),
        ("seed", "18446744073709551616"),
        ("seed", "-1e30"),
        ("n", "1e18"),
        ("top_logprobs", "9223372036854775807"),
    ],
)
def test_huge_json_numbers_are_out_of_range(field: str, literal: str) -> None:
    body = orjson.loads(f'{{"messages": [], "{field}": {literal}}}')
    body["messages"] = MESSAGES
    rejects(body, InvalidRequest, field)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_cannot_come_from_json(literal: str) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(f'{{"temperature": {literal}}}')


def test_max_tokens_cap_is_the_smaller_of_cap_and_context() -> None:
    cap = min(DEFAULTS.max_tokens_cap, DEFAULTS.context_length)
    assert parse({**CHAT, "max_tokens": cap}, "chat", DEFAULTS, SEEDED).request.max_tokens == cap
    rejects({**CHAT, "max_tokens": cap + 1}, InvalidRequest, "max_tokens")
    rejects({**CHAT, "max_completion_tokens": cap + 1}, InvalidRequest, "max_completion_tokens")
    rejects({**CHAT, "max_tokens": DEFAULTS.max_tokens_cap + 1}, InvalidRequest, "max_tokens")


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    body = {**CHAT, "max_tokens": 5, "max_completion_tokens": 7}
    assert parse(body, "chat", DEFAULTS, SEEDED).request.max_tokens == 7


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": {"role": "user", "content": "x"}}, "messages"),
        ({"messages": ["hello"]}, "messages[0]"),
        ({"messages": [*MESSAGES, None]}, "messages[1]"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "User", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": {"user": 1}, "content": "x"}]}, "messages[0].role"),
        ({"messages": [*MESSAGES, {"role": "user"}]}, "messages[1].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": {"type": "text"}}]}, "messages[0].content"),
    ],
)
def test_bad_messages(body: dict[str, Any], param: str) -> None:
    rejects(body, InvalidRequest, param)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"text": "no type"},
        "a bare string",
        None,
    ],
    ids=repr,
)
def test_non_text_content_part_is_unsupported(part: Any) -> None:
    content = [{"type": "text", "text": "look: "}, part]
    rejects(
        {"messages": [{"role": "user", "content": content}]}, Unsupported, "messages[0].content"
    )


@pytest.mark.parametrize("part", [{"type": "text", "text": 5}, {"type": "text"}], ids=repr)
def test_bad_text_part_names_the_message(part: dict[str, Any]) -> None:
    rejects(
        {"messages": [{"role": "user", "content": [part]}]}, InvalidRequest, "messages[0].content"
    )


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": None},
        {"prompt": 5},
        {"prompt": ""},
        {"prompt": [""]},
        {"prompt": ["a", "b"]},
        {"prompt": [1, 2, 3]},
        {"prompt": []},
        {"prompt": {"text": "a"}},
    ],
    ids=repr,
)
def test_bad_prompt(body: dict[str, Any]) -> None:
    rejects(body, InvalidRequest, "prompt", endpoint="completions")


def test_a_chat_body_on_completions_is_told_where_it_belongs() -> None:
    rejects({"messages": MESSAGES}, Unsupported, "messages", endpoint="completions")
    with pytest.raises(Unsupported, match="belongs to /v1/chat/completions"):
        parse({"messages": MESSAGES}, "completions", DEFAULTS, SEEDED)
    with pytest.raises(Unsupported, match="belongs to /v1/completions"):
        parse({**CHAT, "prompt": "Once"}, "chat", DEFAULTS, SEEDED)


def test_one_element_prompt_list_is_the_prompt() -> None:
    parsed = parse({"prompt": ["Once upon"]}, "completions", DEFAULTS, SEEDED)
    assert parsed.request.prompt == "Once upon"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (5, InvalidRequest),
        ({"x": 1}, InvalidRequest),
        ([1], InvalidRequest),
        (["a", 1], InvalidRequest),
        (["a", "b", "c", "d", "e"], InvalidRequest),
        ("", InvalidRequest),
        (["a", ""], InvalidRequest),
    ],
    ids=repr,
)
def test_bad_stop(value: Any, error: type[ProxyError]) -> None:
    rejects({**CHAT, "stop": value}, error, "stop")


@pytest.mark.parametrize(
    "value",
    [
        [1, 2],
        "x",
        3,
        {"abc": 1},
        {"-1": 1},
        {"1.5": 1},
        {"": 1},
        {" 1": 1},
        {"05": 1},
        {"00": 1},
        {"²": 1},
        {"١": 1},
        {"１": 1},
    ],
    ids=repr,
)
def test_bad_logit_bias_keys(value: Any) -> None:
    rejects({**CHAT, "logit_bias": value}, InvalidRequest, "logit_bias")


@pytest.mark.parametrize("value", [101, -100.5, "1", True, [1]], ids=repr)
def test_bad_logit_bias_values_name_logit_bias(value: Any) -> None:
    rejects({**CHAT, "logit_bias": {"5": value}}, InvalidRequest, "logit_bias")


@pytest.mark.parametrize("value", [101, -100.5, "1", True, [1]], ids=repr)
def test_bad_logit_bias_values_are_rejected(value: Any) -> None:
    with pytest.raises(InvalidRequest):
        parse({**CHAT, "logit_bias": {"5": value}}, "chat", DEFAULTS, SEEDED)


TOOL_FIELDS = [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("functions", [{"name": "f"}]),
    ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}),
]


@pytest.mark.parametrize(("field", "value"), TOOL_FIELDS)
def test_tools_and_response_format_are_unsupported_in_completions(field: str, value: Any
                                                                   ) -> None:
    rejects({**COMPLETION, field: value}, Unsupported, field, endpoint="completions")


@pytest.mark.parametrize(("field", "value", "error"), [
    *[(f, v, Unsupported) for f, v in TOOL_FIELDS if f != "tool_choice"],  # DEFAULTS: no parser
    ("tool_choice", "auto", InvalidRequest),  # no tools to choose from
])
def test_chat_tools_need_a_model_that_parses_calls(field: str, value: Any,
                                                   error: type[ProxyError]) -> None:
    rejects({**CHAT, field: value}, error, field)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("suffix", "the end", Unsupported),
        ("echo", True, Unsupported),
        ("best_of", 2, InvalidRequest),
        ("best_of", "2", InvalidRequest),
    ],
)
def test_completions_only_unsupported(field: str, value: Any, error: type[ProxyError]) -> None:
    rejects({**COMPLETION, field: value}, error, field, endpoint="completions")


@pytest.mark.parametrize("model", ["gpt-4o", "Demo", "demo ", "/path/demo/", "", "path/demo"])
def test_unknown_model(model: str) -> None:
    rejects({**CHAT, "model": model}, ModelNotFound, "model")


@pytest.mark.parametrize("model", [5, ["demo"], {"id": "demo"}, True], ids=repr)
def test_model_must_be_a_string(model: Any) -> None:
    rejects({**CHAT, "model": model}, InvalidRequest, "model")


@pytest.mark.parametrize("mode", [SamplingMode.SEEDED, SamplingMode.BYPASS])
@pytest.mark.parametrize("seed", [None, 1])
def test_n_above_one_needs_greedy(mode: SamplingMode, seed: int | None) -> None:
    rejects({**CHAT, "temperature": 0.7, "seed": seed, "n": 2}, Unsupported, "n", mode=mode)


@pytest.mark.parametrize("mode", list(SamplingMode))
def test_n_above_one_is_fine_when_greedy(mode: SamplingMode) -> None:
    temperature = 0.7 if mode is SamplingMode.FORCE_GREEDY else 0
    parsed = parse({**CHAT, "temperature": temperature, "n": 4}, "chat", DEFAULTS, mode)
    assert parsed.delivery.n == 4
    assert parsed.request.sampling == GREEDY


@pytest.mark.parametrize("body", [None, [], [CHAT], "x", 1, 1.5, True], ids=repr)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_body_must_be_an_object(body: object, endpoint: Endpoint) -> None:
    rejects(body, InvalidRequest, None, endpoint=endpoint)


def test_error_renders_openai_shape() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse({**CHAT, "temperature": 9}, "chat", DEFAULTS, SEEDED)
    assert info.value.status == 400
    assert info.value.body() == {
        "error": {
            "message": info.value.message,
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_request_error",
        }
    }


# What a valid request turns into.


def test_defaults_are_filled_in() -> None:
    parsed = parse({"messages": [{"role": "developer", "content": "a"}]}, "chat", DEFAULTS, SEEDED)
    assert parsed.request == CanonicalRequest(
        endpoint="chat",
        model="demo",
        messages=(Message("system", "a"),),
        prompt="",
        max_tokens=256,
        sampling=GREEDY,
        stop=(),
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias=(),
        logprobs=False,
        top_logprobs=0,
    )
    assert parsed.delivery == Delivery(
        stream=False, include_usage=False, n=1, requested_model="demo"
    )


def test_delivery_keeps_what_the_client_asked_for() -> None:
    body = {
        **CHAT,
        "model": "/path/demo",
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True},
    }
    parsed = parse(body, "chat", DEFAULTS, SEEDED)
    assert parsed.request.model == "demo"
    assert parsed.delivery == Delivery(
        stream=True, include_usage=True, n=2, requested_model="/path/demo"
    )


def test_include_usage_needs_stream() -> None:
    body = {**CHAT, "stream_options": {"include_usage": True}}
    assert parse(body, "chat", DEFAULTS, SEEDED).delivery.include_usage is False


# from_wire(wire()) round-trips, directly and through msgpack.

bodies = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
                    "content": st.text(max_size=10)
                    | st.lists(
                        st.fixed_dictionaries(
                            {"type": st.just("text"), "text": st.text(max_size=5)}
                        ),
                        max_size=3,
                    ),
                }
            ),
            min_size=1,
            max_size=3,
        )
    },
    optional={
        "max_tokens": st.integers(1, 512),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(0, 1_000_000),
        "min_p": st.floats(0, 1),
        "seed": st.integers(-(2**63), 2**64 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.01, 10),
        "logit_bias": st.dictionaries(
            st.integers(0, 10**6).map(str), st.floats(-100, 100), max_size=4
        ),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
    },
)


@settings(max_examples=80, deadline=None)
@given(body=bodies, mode=st.sampled_from(list(SamplingMode)))
def test_wire_round_trip(body: dict[str, Any], mode: SamplingMode) -> None:
    request = parse(body, "chat", DEFAULTS, mode).request
    assert CanonicalRequest.from_wire(request.wire(), request.model) == request
    through_msgpack = msgpack.unpackb(msgpack.packb(request.wire()))
    assert CanonicalRequest.from_wire(through_msgpack, request.model) == request


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.text(min_size=1),
    logprobs=st.none() | st.integers(0, 5),
    sampling=st.builds(Sampling, temperature=st.floats(0.01, 2), seed=st.integers(0, 2**64 - 1)),
)
def test_wire_round_trip_completions(prompt: str, logprobs: int | None, sampling: Sampling) -> None:
    body = {
        "prompt": prompt,
        "logprobs": logprobs,
        "temperature": sampling.temperature,
        "seed": sampling.seed,
    }
    request = parse(body, "completions", DEFAULTS, SEEDED).request
    assert request.sampling == sampling
    assert CanonicalRequest.from_wire(msgpack.unpackb(msgpack.packb(request.wire())),
                                     request.model) == request


def test_an_answer_over_the_budget_is_refused_before_anything_runs() -> None:
    # (#19) choices x tokens x (1 + logprob alternatives): a 300-byte body must not ask for MBs.
    body = {**CHAT, "n": 16, "max_tokens": 100, "logprobs": True, "top_logprobs": 20}
    with pytest.raises(AnswerTooLarge) as info:
        parse(body, "chat", DEFAULTS, GREEDY_MODE, max_answer_tokens=16 * 100 * 21 - 1)
    assert info.value.param == "max_tokens" and info.value.code == "response_too_large"
    assert "16" in info.value.message and "21" in info.value.message
    parse(body, "chat", DEFAULTS, GREEDY_MODE, max_answer_tokens=16 * 100 * 21)  # at it: fine
    no_logprobs = {**CHAT, "n": 16, "max_tokens": 100}
    parse(no_logprobs, "chat", DEFAULTS, GREEDY_MODE, max_answer_tokens=1600)
