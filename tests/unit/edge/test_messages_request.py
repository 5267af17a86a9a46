"""A Messages body keys as the chat body that asks for the same answer; each field is applied,
passed (never keyed) or refused by name; Anthropic's thinking and effort reach the template's
switch as chat's reasoning_effort does."""

from __future__ import annotations

from typing import Any

import pytest

from cacheproxy.edge.apis.messages.request import parse_messages
from cacheproxy.errors import InvalidRequest
from cacheproxy.keys.canonical import Parsed, RunnerDefaults, parse
from cacheproxy.keys.key import make_key
from policies.sampling import SamplingMode

DEFAULTS = RunnerDefaults(model_id="demo", aliases=frozenset(), max_tokens=256,
                          max_tokens_cap=4096, context_length=512, tool_calling=True,
                          tool_format="json_tools", grammar_engine="llguidance 1.9.1",
                          template_kwargs={"enable_thinking": True})
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = {"role": "user", "content": "What is the weather in Paris?"}


def messages(**body: Any) -> Parsed:
    return parse_messages({"model": "demo", "max_tokens": 64, "messages": [ASK], **body},
                          DEFAULTS, SamplingMode.FORCE_GREEDY)


def chat(**body: Any) -> Parsed:
    """The chat twin of a Messages request: thinking off unless said (Messages' default)."""
    body.setdefault("chat_template_kwargs", {"enable_thinking": False})
    return parse({"model": "demo", "max_tokens": 64, "messages": [ASK], **body}, "chat",
                 DEFAULTS, SamplingMode.FORCE_GREEDY)


def key(parsed: Parsed) -> str:
    return make_key(parsed.request, "fp").request_hash


def test_a_conversation_with_tools_keys_as_its_chat_twin() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {"city": "Paris"}, "cache_control": {"type": "ephemeral"}}
    history = [ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I look it up.", "signature": "sig"},
        {"type": "text", "text": "Let me see."}, call]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "foggy"}]},
            {"type": "text", "text": "And tomorrow?"}]}]
    ours = messages(system=[{"type": "text", "text": "Be brief.",
                             "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                    messages=history, stop_sequences=["END"],
                    tools=[{"name": "get_weather", "input_schema": SCHEMA,
                            "cache_control": {"type": "ephemeral"}}],
                    tool_choice={"type": "any", "disable_parallel_tool_use": True},
                    metadata={"user_id": "u1"}, service_tier="auto", speed="fast",
                    inference_geo="us", user_profile_id="p", workspace_id="w",
                    diagnostics={"previous_message_id": None})
    twin = chat(messages=[
        {"role": "system", "content": "Be brief."}, ASK,
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "I look it up.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "foggy"},
        {"role": "user", "content": "And tomorrow?"}],
        stop=["END"], tools=[{"type": "function", "function": {
            "name": "get_weather", "parameters": SCHEMA}}],
        tool_choice="required", parallel_tool_calls=False)
    assert ours.request == twin.request and key(ours) == key(twin)
    assert ours.delivery.api == "messages"
    # Control: the same conversation with the call answered as an error is another entry.
    history[2]["content"][0]["is_error"] = True
    assert key(messages(messages=history, tools=[{"name": "get_weather",
                                                  "input_schema": SCHEMA}])) != key(ours)


ADAPTIVE = {"type": "adaptive"}


@pytest.mark.parametrize(("thinking", "effort", "kwargs", "chat_effort"), [
    # Absent is off, as in Anthropic's API (the template here thinks by default).
    (None, None, {"enable_thinking": False}, None),
    (ADAPTIVE, None, {"enable_thinking": True}, None),
    ({"type": "disabled"}, None, {"enable_thinking": False}, None),
    (ADAPTIVE, "high", {"enable_thinking": True}, "high"),
    (ADAPTIVE, "max", {"enable_thinking": True}, "xhigh"),
    (None, "low", {"enable_thinking": False, "reasoning_effort": "low"}, None),
])
def test_thinking_and_effort_are_the_templates_switch_as_in_chat(
    thinking: dict[str, Any] | None, effort: str | None, kwargs: dict[str, Any],
    chat_effort: str | None,
) -> None:
    ours = messages(thinking=thinking, output_config={"effort": effort} if effort else None)
    twin = chat(chat_template_kwargs=kwargs, reasoning_effort=chat_effort)
    assert ours.request == twin.request


def test_a_thinking_budget_is_keyed_as_the_templates_thinking_budget() -> None:
    # No runner can cut a thought short: the budget is keyed (and a template may read it).
    enabled = {"type": "enabled", "budget_tokens": 1024}
    ours = messages(max_tokens=2048, thinking=enabled)
    twin = chat(max_tokens=512, chat_template_kwargs={"enable_thinking": True,
                                                      "thinking_budget": 1024})
    assert ours.request == twin.request
    # Control: another budget is another entry, not the same one silently.
    assert key(messages(max_tokens=2048, thinking={**enabled, "budget_tokens": 2000})) != \
        key(ours)
    assert key(messages(max_tokens=2048, thinking=ADAPTIVE)) != key(ours)


@pytest.mark.parametrize(("thinking", "said"), [
    ({"type": "enabled", "budget_tokens": 1023}, "at least 1024"),
    ({"type": "enabled", "budget_tokens": 2048}, "less than max_tokens (2048)"),
    ({"type": "enabled"}, "required"),
    ({"type": "enabled", "budget_tokens": "1024"}, "an integer"),
    ({"type": "enabled", "budget_tokens": True}, "an integer"),
    ({"type": "adaptive", "budget_tokens": 1024}, "for thinking.type enabled"),
    ({"type": "disabled", "budget_tokens": 1024}, "for thinking.type enabled"),
])
def test_a_thinking_budget_is_checked_as_anthropic_checks_it(thinking: dict[str, Any],
                                                             said: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        messages(max_tokens=2048, thinking=thinking)
    assert refused.value.param == "thinking.budget_tokens" and said in refused.value.message


def test_absent_thinking_is_not_the_templates_default() -> None:
    # Control of the row above: chat's absent switch is the template's (on), Messages' is off.
    plain = parse({"model": "demo", "max_tokens": 64, "messages": [ASK]}, "chat", DEFAULTS,
                  SamplingMode.FORCE_GREEDY)
    assert messages().request != plain.request
    assert messages(thinking=ADAPTIVE).request == plain.request


def test_disabled_thinking_with_an_effort_keeps_the_level_for_the_template() -> None:
    ours = messages(thinking={"type": "disabled"}, output_config={"effort": "low"})
    assert ours.request.template_kwargs == '{"enable_thinking":false,"reasoning_effort":"low"}'


def test_output_format_is_a_json_schema_response_format() -> None:
    form = {"type": "json_schema", "schema": SCHEMA}
    twin = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "anything", "schema": SCHEMA}})
    assert messages(output_config={"format": form}).request == twin.request
    assert messages(output_format=form).request == twin.request  # the older beta field


def test_max_tokens_is_required_and_capped_and_sampling_is_passed_on() -> None:
    with pytest.raises(InvalidRequest) as missing:
        parse_messages({"model": "demo", "messages": [ASK]}, DEFAULTS,
                       SamplingMode.FORCE_GREEDY)
    assert missing.value.param == "max_tokens"
    assert messages(max_tokens=64000).request.max_tokens == 512  # the context: the most
    sampled = parse_messages({"model": "demo", "max_tokens": 64, "messages": [ASK],
                              "temperature": 1, "top_k": 5}, DEFAULTS, SamplingMode.SEEDED)
    assert not sampled.sampling.decision.cacheable  # unseeded sampling, as in chat
    assert messages().sampling.sampling.is_greedy  # no temperature: greedy, as in chat


@pytest.mark.parametrize(("body", "param"), [
    ({"top_a": 1}, "top_a"),
    ({"container": "c1"}, "container"),
    ({"mcp_servers": [{"name": "x"}]}, "mcp_servers"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f", "input_schema": SCHEMA, "input_examples": [{}]}]},
     "tools[0].input_examples"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [ASK, {"role": "assistant", "content": "The weather is"}]}, "messages[1]"),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking.budget_tokens"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"temperature": 1.5}, "temperature"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"name": "get weather", "input_schema": SCHEMA}]}, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": SCHEMA, "parameters": SCHEMA}]},
     "tools[0].parameters"),  # a key of no Anthropic tool: refused, not ignored
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [  # unhashable: was a TypeError, a 500
        {"type": "tool_result", "tool_use_id": ["toolu_9"], "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
])
def test_what_cannot_be_honoured_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        messages(**body)
    assert refused.value.param == param and param.split(".")[0] in refused.value.message


def test_a_tool_s_keys_are_the_sdk_s() -> None:
    # Each key of anthropic's ToolParam has its decision in _tool (applied, moot or refused);
    # an SDK that defines a new one fails here. (A Messages tool is checked before it becomes
    # a chat tool: the chat tool's own key check never sees a key it did not put there.)
    from anthropic.types import tool_param

    from cacheproxy.edge.apis.messages import tools

    typed, known = tool_param.ToolParam, tools._TOOL_KEYS
    assert known == typed.__required_keys__ | typed.__optional_keys__


def test_stop_sequences_take_more_than_chats_four_within_a_bound() -> None:
    from cacheproxy.edge.apis.messages.request import MAX_STOP_SEQUENCES

    many = [f"STOP{i}" for i in range(MAX_STOP_SEQUENCES)]
    assert messages(stop_sequences=many).request.stop == tuple(sorted(many))
    with pytest.raises(InvalidRequest) as refused:
        messages(stop_sequences=[*many, "ONE MORE"])
    assert refused.value.param == "stop_sequences"
    assert f"at most {MAX_STOP_SEQUENCES} sequences" in refused.value.message
    # Control: chat's `stop` keeps OpenAI's bound of 4.
    with pytest.raises(InvalidRequest) as chats:
        chat(stop=many[:5])
    assert chats.value.param == "stop" and "at most 4" in chats.value.message


CALL = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "foggy"}
AFTER = {"type": "text", "text": "And tomorrow?"}


@pytest.mark.parametrize(("history", "param", "said"), [
    ([ASK, CALL, {"role": "user", "content": [AFTER, RESULT]}], "messages[2].content[1]",
     "tool_result blocks come first"),
    ([ASK, CALL, {"role": "user", "content": [RESULT, RESULT]}],
     "messages[2].content[1].tool_use_id", "'toolu_1' is answered twice"),
    ([ASK, CALL, {"role": "user", "content": [RESULT]},
      {"role": "assistant", "content": "Foggy."}, {"role": "user", "content": [RESULT, AFTER]}],
     "messages[4].content[0].tool_use_id", "'toolu_1' is answered twice"),
])
def test_tool_results_come_first_and_answer_a_call_once(history: list[Any], param: str,
                                                        said: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        messages(messages=history, tools=[{"name": "get_weather", "input_schema": SCHEMA}])
    assert refused.value.param == param and said in refused.value.message
    # Control: the result first and once, then the text, is a conversation.
    messages(messages=[ASK, CALL, {"role": "user", "content": [RESULT, AFTER]}],
             tools=[{"name": "get_weather", "input_schema": SCHEMA}])
