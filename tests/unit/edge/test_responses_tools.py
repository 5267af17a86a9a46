"""The keys of a Responses function or namespace tool: every key OpenAI's schema defines is
applied, moot or refused by its path; any other is a 400 naming `tools[i].key`."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import function_tool_param, namespace_tool_param

from cacheproxy.edge.apis.responses import tools as responses_tools
from cacheproxy.errors import InvalidRequest, Unsupported
from tests.unit.edge.test_responses_fields import AGENTS, ASK, SPAWN, chat_key


def _keys(typed: Any) -> frozenset[str]:
    return frozenset(typed.__required_keys__ | typed.__optional_keys__)


def test_the_keys_known_are_the_sdks() -> None:
    # An SDK that defines a new key fails here, so that its decision is taken, not skipped.
    assert _keys(function_tool_param.FunctionToolParam) == responses_tools._FUNCTION_KEYS
    assert _keys(namespace_tool_param.ToolFunction) == responses_tools._FUNCTION_KEYS
    assert _keys(namespace_tool_param.NamespaceToolParam) == responses_tools._NAMESPACE_KEYS


@pytest.mark.parametrize("extra", [
    {"defer_loading": False}, {"defer_loading": None},  # nothing deferred
    {"allowed_callers": ["direct"]}, {"allowed_callers": ["direct", "programmatic"]},
    {"allowed_callers": None}, {"output_schema": None},
])
def test_a_key_that_is_moot_here_is_accepted_and_not_keyed(extra: dict[str, Any]) -> None:
    assert chat_key({**ASK, "tools": [{**SPAWN, **extra}]}) == chat_key({**ASK, "tools": [SPAWN]})
    nested = {**AGENTS, "tools": [{**SPAWN, **extra}]}
    assert chat_key({**ASK, "tools": [nested]}) == chat_key({**ASK, "tools": [AGENTS]})


def test_the_applied_keys_are_keyed() -> None:
    # The control of the moot ones: the same comparison tells a key that changes the prompt.
    plain = chat_key({**ASK, "tools": [SPAWN]})
    assert chat_key({**ASK, "tools": [{**SPAWN, "description": "Other."}]}) != plain
    assert chat_key({**ASK, "tools": [{**SPAWN, "parameters": {"type": "object"}}]}) != plain


def _refused(tools: list[Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        chat_key({**ASK, "tools": tools})
    return refused.value


@pytest.mark.parametrize(("tools", "param"), [
    ([SPAWN, {**SPAWN, "name": "other", "returns": "string"}], "tools[1].returns"),
    ([{**AGENTS, "icon": "robot"}], "tools[0].icon"),
    ([{**AGENTS, "tools": [{**SPAWN, "function": {"name": "x"}}]}], "tools[0].tools[0].function"),
    ([{**SPAWN, "defer_loading": True}], "tools[0].defer_loading"),
    ([{**AGENTS, "tools": [{**SPAWN, "defer_loading": True}]}], "tools[0].tools[0].defer_loading"),
    ([{**SPAWN, "allowed_callers": ["programmatic"]}], "tools[0].allowed_callers"),
    ([{**SPAWN, "allowed_callers": []}], "tools[0].allowed_callers"),
    ([{**SPAWN, "output_schema": {"type": "object"}}], "tools[0].output_schema"),
])
def test_an_unknown_key_or_one_that_would_matter_is_refused_by_its_path(
        tools: list[Any], param: str) -> None:
    refused = _refused(tools)
    assert type(refused) is Unsupported and refused.param == param
    assert refused.code == "unsupported_parameter" and param in refused.message


@pytest.mark.parametrize(("extra", "param"), [
    ({"defer_loading": "yes"}, "tools[0].defer_loading"),
    ({"allowed_callers": "direct"}, "tools[0].allowed_callers"),
    ({"allowed_callers": ["direct", {"x": 1}]}, "tools[0].allowed_callers"),
])
def test_a_moot_key_of_the_wrong_type_is_a_400(extra: dict[str, Any], param: str) -> None:
    refused = _refused([{**SPAWN, **extra}])
    assert type(refused) is InvalidRequest and refused.param == param


def test_codex_s_tools_pass() -> None:
    # Codex 0.171 serializes a function tool as these keys (`defer_loading` only when true,
    # which it sets only with its tool search, a hosted tool refused by type).
    codex = {"type": "function", "name": "shell", "description": "Runs a command.",
             "strict": False, "parameters": {"type": "object", "properties": {
                 "command": {"type": "array", "items": {"type": "string"}}}}}
    chat, _ = responses_tools.tools([codex, AGENTS])
    assert [t["function"]["name"] for t in chat] == ["shell", "spawn_agent"]
