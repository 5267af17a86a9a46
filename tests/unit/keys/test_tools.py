"""Tools, tool history, tool_choice and template kwargs in the canonical request and the key:
order that means nothing never splits a key, anything the prompt or the decoding sees does,
and bad input is a 400 naming the field (with a real code)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheproxy.errors import InvalidRequest, ProxyError, Unsupported
from cacheproxy.keys.canonical import RunnerDefaults, parse
from cacheproxy.keys.key import make_key
from cacheproxy.keys.tools import schema
from policies.sampling import SamplingMode
from tests.unit.keys.test_keys import shuffled

DEFAULTS = RunnerDefaults(model_id="demo", aliases=frozenset(), max_tokens=256,
                          max_tokens_cap=4096, context_length=512,
                          template_kwargs={"enable_thinking": True}, tool_calling=True)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
BODY: dict[str, Any] = {"messages": ASK, "tools": [WEATHER, TIME]}
CALLED = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]


def key(body: dict[str, Any], defaults: RunnerDefaults = DEFAULTS) -> str:
    return make_key(parse(body, "chat", defaults, SamplingMode.FORCE_GREEDY).request, "f" * 32)


def rejects(body: dict[str, Any], param: str | None,
            error: type[ProxyError] = InvalidRequest) -> None:
    with pytest.raises(ProxyError) as info:
        key(body)
    assert type(info.value) is error, info.value
    assert info.value.param == param, info.value
    assert info.value.body()["error"]["code"] in ("invalid_request_error",
                                                  "unsupported_parameter")


def changed(path: list[Any], value: Any, body: dict[str, Any] = BODY) -> dict[str, Any]:
    """A deep copy of body with the item at `path` set to value."""
    out = copy.deepcopy(body)
    target = out
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return out


# Order and spelling that carry no meaning share a key.


@settings(max_examples=40, deadline=None)
@given(rnd=st.randoms(use_true_random=False))
def test_keyword_order_of_tools_and_history_never_splits_a_key(rnd: random.Random) -> None:
    body = {**BODY, "messages": CALLED}
    # Every object's keys shuffled, except properties (their order is the output's order).
    mixed = shuffled(body, rnd)
    for tool, original in zip(mixed["tools"], body["tools"], strict=True):
        tool["function"]["parameters"]["properties"] = \
            original["function"]["parameters"]["properties"]
    mixed["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    assert key(mixed) == key(body)


def test_equivalent_spellings_share_a_key() -> None:
    assert key(changed(["tools", 0, "function", "parameters", "required"], ["unit", "city"])) \
        == key(BODY)
    assert key(changed(["tools", 0, "function", "parameters", "properties", "city", "maxLength"],
                       10.0)) == key(changed(["tools", 0, "function", "parameters", "properties",
                                              "city", "maxLength"], 10))
    assert key({**BODY, "messages": [*CALLED[:1], {**CALLED[1], "tool_calls": [
        {**CALLED[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}, CALLED[2]]}) == \
        key({**BODY, "messages": CALLED})  # arguments as an object or as its JSON text
    assert key({**BODY, "tool_choice": "auto"}) == key(BODY)  # the default with tools
    assert key({**BODY, "parallel_tool_calls": True}) == key(BODY)


def test_explicit_template_defaults_share_a_key() -> None:
    assert key({**BODY, "chat_template_kwargs": {"enable_thinking": True}}) == key(BODY)
    assert key({**BODY, "chat_template_kwargs": {"a": 1, "b": {"y": 2, "x": 1}}}) == \
        key({**BODY, "chat_template_kwargs": {"b": {"x": 1, "y": 2}, "a": 1}})


def test_tool_choice_none_is_a_request_without_tools() -> None:
    assert key({**BODY, "tool_choice": "none"}) == key({"messages": ASK})
    assert key({"messages": ASK, "parallel_tool_calls": False}) == key({"messages": ASK})


# Anything the prompt or the decoding sees changes the key.


@pytest.mark.parametrize("other", [
    changed(["tools", 0, "function", "description"], "Weather."),
    changed(["tools", 0, "function", "name"], "weather"),
    changed(["tools", 0, "function", "parameters", "properties", "city", "type"], "number"),
    changed(["tools", 0, "function", "parameters", "required"], ["city"]),
    changed(["tools", 0, "function", "parameters", "properties", "unit", "enum"],
            ["fahrenheit", "celsius"]),
    changed(["tools", 0, "function", "parameters", "properties"], {
        "unit": WEATHER["function"]["parameters"]["properties"]["unit"],  # type: ignore[index]
        "city": WEATHER["function"]["parameters"]["properties"]["city"]}),  # type: ignore[index]
    {**BODY, "tools": [TIME, WEATHER]},
    {**BODY, "tools": [WEATHER]},
    {**BODY, "tool_choice": "required"},
    {**BODY, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {**BODY, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    {**BODY, "parallel_tool_calls": False},
    {**BODY, "chat_template_kwargs": {"enable_thinking": False}},
    {**BODY, "chat_template_kwargs": {"custom": "x"}},
    {**BODY, "messages": CALLED},
    {**BODY, "reasoning_effort": "none"},
    {**BODY, "reasoning_effort": "high"},
], ids=["description", "name", "parameter type", "required", "enum order", "properties order",
        "tool order", "fewer tools", "required choice", "named", "other named", "parallel",
        "thinking off", "a kwarg", "history", "effort none", "effort high"])
def test_what_changes_the_prompt_or_decoding_changes_the_key(other: dict[str, Any]) -> None:
    assert key(other) != key(BODY)


def test_history_details_change_the_key() -> None:
    base = key({**BODY, "messages": CALLED})
    for other in (
        changed([1, "tool_calls", 0, "function", "arguments"], '{"city": "Lyon"}', CALLED),
        changed([1, "tool_calls", 0, "id"], "call_2", CALLED),
        changed([2, "content"], "rainy", CALLED),
        changed([1, "reasoning_content"], "I call the tool.", CALLED),
    ):
        if other[1]["tool_calls"][0]["id"] == "call_2":
            other[2]["tool_call_id"] = "call_2"
        assert key({**BODY, "messages": other}) != base


def test_a_schemas_keywords_are_sorted_and_its_properties_kept_in_order() -> None:
    got = schema({"type": "object", "required": ["b", "a", "a"],
                  "properties": {"z": {"type": "string", "enum": [3, 1.0]}, "a": {}},
                  "$defs": {"y": {"type": "integer"}, "x": {"minimum": 2.0}}})
    assert list(got) == ["$defs", "properties", "required", "type"]
    assert list(got["properties"]) == ["z", "a"]
    assert got["properties"]["z"]["enum"] == [3, 1]
    assert got["required"] == ["a", "b"]
    assert list(got["$defs"]) == ["x", "y"] and got["$defs"]["x"] == {"minimum": 2}


# The legacy forms map onto the new ones.


def test_legacy_functions_and_function_call_are_tools() -> None:
    legacy = {"messages": ASK, "functions": [WEATHER["function"]],
              "function_call": {"name": "get_weather"}}
    parsed = parse(legacy, "chat", DEFAULTS, SamplingMode.FORCE_GREEDY)
    assert parsed.request.tool_choice == "function" and parsed.request.tool_name == "get_weather"
    assert parsed.request.parallel_tool_calls is False and parsed.delivery.legacy_functions
    history = [*ASK, {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "sunny"}]
    messages = parse({"messages": history, "functions": [WEATHER["function"]]}, "chat",
                     DEFAULTS, SamplingMode.FORCE_GREEDY).request.messages
    assert messages[1].tool_calls[0].id == messages[2].tool_call_id == "function-call-1"
    assert messages[2].role == "tool"


def test_echoed_empty_response_fields_are_accepted() -> None:
    echoed = [*ASK, {**CALLED[1], "refusal": None, "annotations": [], "audio": None,
                     "function_call": None}, CALLED[2]]
    assert key({**BODY, "messages": echoed}) == key({**BODY, "messages": CALLED})
    echoed[1]["function_call"] = {}
    assert key({**BODY, "messages": echoed}) == key({**BODY, "messages": CALLED})


# Bad input names the field.


@pytest.mark.parametrize(("body", "param", "error"), [
    ({**BODY, "tools": {"a": 1}}, "tools", InvalidRequest),
    ({**BODY, "tools": [{"type": "code_interpreter"}]}, "tools[0].type", Unsupported),
    (changed(["tools", 0, "function", "name"], "get weather"), "tools[0].function.name",
     InvalidRequest),
    (changed(["tools", 0, "function", "parameters"], {"type": "object", "properties": 3}),
     "tools[0].function.parameters", InvalidRequest),
    (changed(["tools", 0, "function", "parameters"], {"type": "strin"}),
     "tools[0].function.parameters", InvalidRequest),
    (changed(["tools", 0, "function", "parameters"], {"type": "string"}),
     "tools[0].function.parameters", InvalidRequest),
    ({**BODY, "tools": [WEATHER, WEATHER]}, "tools", InvalidRequest),
    ({**BODY, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", InvalidRequest),
    ({**BODY, "tool_choice": "always"}, "tool_choice", InvalidRequest),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice", InvalidRequest),
    ({**BODY, "functions": [WEATHER["function"]]}, "functions", InvalidRequest),
    ({**BODY, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", InvalidRequest),
    ({**BODY, "chat_template_kwargs": []}, "chat_template_kwargs", InvalidRequest),
    ({**BODY, "messages": [*ASK, {"role": "tool", "content": "sunny"}]},
     "messages[1].tool_call_id", InvalidRequest),
    ({**BODY, "messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages[1].tool_call_id", InvalidRequest),
    ({**BODY, "messages": changed([1, "tool_calls", 0, "function", "arguments"], "{oops",
                                  CALLED)}, "messages[1].tool_calls[0].function.arguments",
     InvalidRequest),
    ({**BODY, "messages": changed([1, "tool_calls", 0, "function", "arguments"], "[1]",
                                  CALLED)}, "messages[1].tool_calls[0].function.arguments",
     InvalidRequest),
    ({**BODY, "messages": changed([1, "tool_calls", 0, "id"], "", CALLED)},
     "messages[1].tool_calls[0].id", InvalidRequest),
    ({**BODY, "messages": [{**ASK[0], "tool_calls": []}, {**ASK[0], "tool_call_id": "x"}]},
     "messages[1].tool_call_id", InvalidRequest),
    ({**BODY, "messages": [{**ASK[0], "refusal": "no"}]}, "messages[0].refusal", Unsupported),
    ({**BODY, "messages": [{**ASK[0], "function_call": {"name": "get_weather"}}]},
     "messages[0].function_call", InvalidRequest),
    ({**BODY, "messages": [*ASK, {**CALLED[1], "tool_call_id": "call_1"}]},
     "messages[1].tool_call_id", InvalidRequest),
    ({**BODY, "reasoning_effort": "extreme"}, "reasoning_effort", InvalidRequest),
    ({**BODY, "reasoning_effort": ["high"]}, "reasoning_effort", InvalidRequest),
    ({**BODY, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
     "reasoning_effort", InvalidRequest),
    ({**BODY, "chat_template_kwargs": {"truncation": True, "max_length": 8}},
     "chat_template_kwargs", InvalidRequest),
    ({**BODY, "verbosity": "low"}, "verbosity", Unsupported),
    ({**BODY, "modalities": ["text", "audio"]}, "modalities", Unsupported),
    ({**BODY, "messages": [{**ASK[0], "audio": {"id": "a"}}]}, "messages[0].audio",
     Unsupported),
])
def test_bad_tool_input_names_the_field(body: dict[str, Any], param: str,
                                        error: type[ProxyError]) -> None:
    rejects(body, param, error)


def test_strict_false_is_a_tool_without_strict() -> None:
    # (strict true is enforced by constrained decoding: tests/unit/keys/test_structured_keys.py)
    assert key(changed(["tools", 0, "function", "strict"], False)) == key(BODY)
    rejects(changed(["tools", 0, "function", "strict"], True), "tools", Unsupported)


def test_tools_for_a_model_whose_calls_cannot_be_parsed_are_refused() -> None:
    plain = RunnerDefaults(model_id="demo", aliases=frozenset(), max_tokens=256,
                           max_tokens_cap=4096, context_length=512)
    with pytest.raises(Unsupported) as info:
        key(BODY, plain)
    assert info.value.param == "tools"
    assert key({**BODY, "tool_choice": "none"}, plain)  # no tools offered: fine


def test_completions_refuse_chat_only_fields() -> None:
    for name, value in (("tools", [WEATHER]), ("chat_template_kwargs", {"a": 1}),
                        ("tool_choice", "auto")):
        with pytest.raises(Unsupported) as info:
            parse({"prompt": "x", name: value}, "completions", DEFAULTS,
                  SamplingMode.FORCE_GREEDY)
        assert info.value.param == name


def test_reasoning_effort_reaches_the_template_both_ways() -> None:
    parsed = parse({**BODY, "reasoning_effort": "minimal"}, "chat", DEFAULTS,
                   SamplingMode.FORCE_GREEDY)
    assert parsed.request.template_kwargs == \
        '{"enable_thinking":false,"reasoning_effort":"minimal"}'
    assert key({**BODY, "reasoning_effort": "low"}) != key({**BODY, "reasoning_effort": "high"})


def test_every_apply_chat_template_argument_is_reserved() -> None:
    import inspect

    from transformers import PreTrainedTokenizerBase

    from cacheproxy.keys.tools import RESERVED_TEMPLATE_KWARGS

    arguments = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    assert arguments - {"self", "kwargs"} <= RESERVED_TEMPLATE_KWARGS


def test_a_schema_nested_hundreds_deep_is_a_400_not_a_crash() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(400):
        deep = {"type": "array", "items": deep}
    rejects(changed(["tools", 0, "function", "parameters"], {
        "type": "object", "properties": {"x": deep}}), None)


def test_a_template_that_calls_the_switch_thinking_gets_one_key_for_both_names() -> None:
    renamed = RunnerDefaults(model_id="demo", aliases=frozenset(), max_tokens=256,
                             max_tokens_cap=4096, context_length=512, tool_calling=True,
                             template_kwargs={"thinking": True}, thinking_kwarg="thinking")
    off = key({**BODY, "chat_template_kwargs": {"thinking": False}}, renamed)
    assert key({**BODY, "chat_template_kwargs": {"enable_thinking": False}}, renamed) == off
    assert key({**BODY, "reasoning_effort": "none"}, renamed) != key(BODY, renamed)
    parsed = parse({**BODY, "chat_template_kwargs": {"enable_thinking": False}}, "chat",
                   renamed, SamplingMode.FORCE_GREEDY)
    assert parsed.request.template_kwargs == '{"thinking":false}'
