"""The keys of a chat function tool (`tools[i]`, `tools[i].function`, legacy `functions[i]`):
every key openai's types define is applied, as the clients send them; any other is a 400
naming its path."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from openai.types.chat import chat_completion_function_tool_param, completion_create_params
from openai.types.shared_params import function_definition

from cacheproxy.errors import Unsupported
from cacheproxy.keys import tools
from tests.unit.keys.test_tools import ASK, DEFAULTS, WEATHER, key, rejects

# (strict is enforced: by constrained decoding, on tool calls that are JSON)
CONSTRAINED = replace(DEFAULTS, grammar_engine="llguidance 1.9.1", tool_format="json_tools")


def _keys(typed: Any) -> frozenset[str]:
    return frozenset(typed.__required_keys__ | typed.__optional_keys__)


def test_the_keys_known_are_the_sdks() -> None:
    # An SDK that defines a new key fails here, so that its decision is taken, not skipped.
    known = (tools.TOOL_KEYS, tools.FUNCTION_KEYS, tools.LEGACY_KEYS)
    sdk = (chat_completion_function_tool_param.ChatCompletionFunctionToolParam,
           function_definition.FunctionDefinition, completion_create_params.Function)
    assert known == tuple(_keys(typed) for typed in sdk)


PARAMETERS = WEATHER["function"]["parameters"]
# What the clients of tests/e2e send (LangChain's bind_tools, with and without strict;
# instructor's tools mode; llm, with a null description).
CLIENTS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get weather.",
                                      "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_weather", "description": "Get weather.",
                                      "parameters": PARAMETERS, "strict": True}},
    {"type": "function", "function": {"name": "User", "description": "Extract a user.",
                                      "parameters": {"type": "object", "properties": {
                                          "name": {"title": "Name", "type": "string"}},
                                          "required": ["name"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": None,
                                      "parameters": PARAMETERS}},
]


@pytest.mark.parametrize("tool", CLIENTS)
def test_a_client_s_tool_is_accepted(tool: dict[str, Any]) -> None:
    assert key({"messages": ASK, "tools": [tool]}, CONSTRAINED)


@pytest.mark.parametrize(("where", "extra", "param"), [
    ((), {"cache_control": {"type": "ephemeral"}}, "tools[1].cache_control"),
    ((), {"name": "get_weather"}, "tools[1].name"),  # a Responses tool's flat shape
    (("function",), {"returns": "string"}, "tools[1].function.returns"),
    (("function",), {"input_schema": {}}, "tools[1].function.input_schema"),
    (("function",), {"defer_loading": False}, "tools[1].function.defer_loading"),
])
def test_an_unknown_tool_key_is_refused_by_its_path(
        where: tuple[str, ...], extra: dict[str, Any], param: str) -> None:
    tool = copy.deepcopy(WEATHER)
    target = tool
    for step in where:
        target = target[step]
    target |= extra
    rejects({"messages": ASK, "tools": [CLIENTS[0], tool]}, param, Unsupported)


@pytest.mark.parametrize(("extra", "param"), [
    ({"strict": True}, "functions[0].strict"), ({"type": "function"}, "functions[0].type")])
def test_an_unknown_legacy_function_key_is_refused_by_its_path(
        extra: dict[str, Any], param: str) -> None:
    rejects({"messages": ASK, "functions": [{**WEATHER["function"], **extra}]}, param,
            Unsupported)


def test_the_known_keys_are_applied() -> None:
    # The control of the refusals: each known key is read, and changes the prompt.
    plain = key({"messages": ASK, "tools": [CLIENTS[0]]}, CONSTRAINED)
    for changed in ({"description": "Other."}, {"strict": True},
                    {"parameters": {"type": "object", "properties": {}}}):
        tool = {"type": "function", "function": {**CLIENTS[0]["function"], **changed}}
        assert key({"messages": ASK, "tools": [tool]}, CONSTRAINED) != plain
