"""Upstream mode's guarantee for structured requests: an answer is checked against the
canonical schema a grammar would have enforced (keys/conformance.py), and a runner that
checks answers accepts what one that constrains decoding accepts."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

from cacheproxy.keys.canonical import CanonicalRequest, parse
from cacheproxy.keys.codec import Chunk, Output, ToolCallOut
from cacheproxy.keys.conformance import violation
from policies.sampling import SamplingMode
from tests.unit.keys.test_structured_keys import ASK, DEFAULTS, body

UPSTREAM = replace(DEFAULTS, grammar_engine="", tool_format="", validates_schemas=True)
STRICT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "enum": ["Lima", "Oslo"]}}}}}
FOX = {"animal": "fox", "food": "mice", "where": {"home": "den"}}


def request(request_body: dict[str, Any]) -> tuple[CanonicalRequest, str]:
    parsed = parse(request_body, "chat", UPSTREAM, SamplingMode.FORCE_GREEDY)
    return parsed.request, parsed.schema_guarantee


def answer(text: str = "", *calls: tuple[str, str]) -> Output:
    out = tuple(ToolCallOut(i, name, args) for i, (name, args) in enumerate(calls))
    return Output(chunks=(Chunk(text, (1,), tool_calls=out),), finish_reason="stop",
                  prompt_tokens=3, completion_tokens=1)


def test_a_response_format_answer_is_held_to_its_schema() -> None:
    structured, guarantee = request(body())
    assert guarantee == "validated"
    assert violation(structured, answer(json.dumps(FOX))) is None
    wrong = violation(structured, answer(json.dumps({**FOX, "food": "cake"})))
    assert wrong is not None and "$['food']" in wrong and "'cake'" in wrong
    assert violation(structured, answer("The fox eats mice.")) == "the answer is not JSON"
    extra = violation(structured, answer(json.dumps({**FOX, "colour": "red"})))
    assert extra is not None and "colour" in extra  # additionalProperties: false


def test_json_object_is_any_object_and_text_is_not_checked() -> None:
    as_object, _ = request({"messages": ASK, "response_format": {"type": "json_object"}})
    assert violation(as_object, answer('{"a": [1]}')) is None
    assert violation(as_object, answer("[1, 2]")) is not None
    plain, guarantee = request({"messages": ASK})
    assert guarantee == "" and violation(plain, answer("not JSON at all")) is None


def test_strict_tool_arguments_are_held_to_their_schema_and_other_tools_are_not() -> None:
    loose = copy.deepcopy(STRICT_WEATHER)
    loose["function"].update(name="get_time", strict=False)
    tools, guarantee = request({"messages": ASK, "tools": [STRICT_WEATHER, loose]})
    assert guarantee == "validated"
    assert violation(tools, answer("", ("get_weather", '{"city": "Lima"}'))) is None
    wrong = violation(tools, answer("", ("get_weather", '{"city": "Paris"}')))
    assert wrong is not None and wrong.startswith("the arguments of tool call 0 (get_weather)")
    assert violation(tools, answer("", ("get_time", '{"anything": 1}'))) is None  # not strict
    assert "not offered" in (violation(tools, answer("", ("launch", "{}"))) or "")
    assert violation(tools, answer("It is sunny.")) is None  # no call: nothing to hold


def test_a_constraining_runner_says_enforced_and_the_key_is_the_same_request() -> None:
    # The guarantee differs by runner; the canonical request (so the key) does not.
    enforced = parse(body(), "chat", DEFAULTS, SamplingMode.FORCE_GREEDY)
    validated = parse(body(), "chat", UPSTREAM, SamplingMode.FORCE_GREEDY)
    assert (enforced.schema_guarantee, validated.schema_guarantee) == ("enforced", "validated")
    assert enforced.request == validated.request
