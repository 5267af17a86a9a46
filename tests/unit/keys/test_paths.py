"""An error a chat-level check raises for a Responses or Messages request names the field by
that API's path (`max_output_tokens`, `text.format.schema`, `tools[1].tools[0].parameters`,
`input[3].arguments`; `output_config.format.schema`, `tools[1].input_schema`), in its
`param` and in its message; so does one raised while generating."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from cacheproxy.edge.apis.messages.errors import error_body as messages_error
from cacheproxy.edge.apis.messages.request import parse_messages
from cacheproxy.edge.apis.responses.render import error_body as responses_error
from cacheproxy.edge.apis.responses.request import parse_responses
from cacheproxy.errors import ContextLengthExceeded, InvalidRequest, SchemaTooComplex
from policies.sampling import SamplingMode
from tests.unit.keys.test_tools import DEFAULTS

CONSTRAINED = replace(DEFAULTS, grammar_engine="llguidance 1.9.1", tool_format="json_tools")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}
ASK = {"role": "user", "content": "Weather in Paris?"}
BAD_SCHEMA = {"type": "object", "properties": 3}


def _responses(**body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        parse_responses({"model": "demo", "input": "Hi", **body}, CONSTRAINED,
                        SamplingMode.FORCE_GREEDY, max_answer_tokens=300)
    return refused.value


@pytest.mark.parametrize(("body", "param"), [
    ({"max_output_tokens": 400}, "max_output_tokens"),  # over the answer budget
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": BAD_SCHEMA}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": SCHEMA}}},
     "text.format.name"),
    ({"tools": [TOOL, {**TOOL, "name": "f", "parameters": BAD_SCHEMA}]}, "tools[1].parameters"),
    ({"tools": [{"type": "namespace", "name": "ns", "description": "", "tools": [
        TOOL, {**TOOL, "name": "f", "parameters": {"type": "string"}}]}]},
     "tools[0].tools[1].parameters"),
    ({"tools": [{**TOOL, "name": "get weather"}]}, "tools[0].name"),
    ({"instructions": "Be brief.", "tools": [TOOL],
      "input": [ASK, {**CALL, "arguments": "{oops"}]}, "input[1].arguments"),
    ({"tools": [TOOL], "input": [ASK, {"role": "assistant", "content": "Let me see."},
                                 {**CALL, "arguments": "[1]"}]}, "input[2].arguments"),
    ({"tools": [TOOL], "input": [ASK, CALL, {"type": "function_call_output",
                                             "call_id": "call_9", "output": "x"}]},
     "input[2].call_id"),
])
def test_a_chat_check_of_a_responses_request_names_its_path(
        body: dict[str, Any], param: str) -> None:
    refused = _responses(**body)
    assert refused.param == param and param in refused.message, refused.message
    assert "max_tokens" not in refused.message and "function." not in refused.message


def _messages(**body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        parse_messages({"model": "demo", "max_tokens": 64, "messages": [ASK], **body},
                       CONSTRAINED, SamplingMode.FORCE_GREEDY)
    return refused.value


TOOL_USE = {"name": "get_weather", "input_schema": SCHEMA}


@pytest.mark.parametrize(("body", "param"), [
    ({"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}},
     "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": BAD_SCHEMA}}, "output_format.schema"),
    ({"tools": [TOOL_USE, {"name": "f", "input_schema": {"type": "string"}}]},
     "tools[1].input_schema"),
    # A deferred tool is not a chat tool: the chat tool 0 is the Messages tool 1.
    ({"tools": [{**TOOL_USE, "name": "later", "defer_loading": True},
                {"name": "f", "input_schema": {"type": "string"}}]}, "tools[1].input_schema"),
])
def test_a_chat_check_of_a_messages_request_names_its_path(
        body: dict[str, Any], param: str) -> None:
    refused = _messages(**body)
    assert refused.param == param and f"'{param}'" in refused.message, refused.message
    assert f"'{param}'" in str(messages_error(refused)["error"])  # type: ignore[index]


@pytest.mark.parametrize(("error", "responses", "messages"), [
    (ContextLengthExceeded(600, 512, param="messages"), "input", "messages"),
    (SchemaTooComplex("'response_format' cannot be enforced", param="response_format"),
     "text.format", "output_config.format"),
    (SchemaTooComplex("'tools' cannot be enforced", param="tools"), "tools", "tools"),
])
def test_an_error_raised_while_generating_names_the_api_s_path(
        error: InvalidRequest, responses: str, messages: str) -> None:
    body = responses_error(error)["error"]
    assert isinstance(body, dict) and body["param"] == responses
    shaped = messages_error(error)["error"]
    assert isinstance(shaped, dict)
    if isinstance(error, ContextLengthExceeded):  # its message names no field: its numbers
        assert "600 tokens" in body["message"]
        assert shaped["message"] == "prompt is too long: 600 tokens > 511 maximum"
    else:
        assert f"'{responses}'" in body["message"] and f"'{messages}'" in shaped["message"]
    assert error.param in ("messages", "response_format", "tools")  # the original untouched
