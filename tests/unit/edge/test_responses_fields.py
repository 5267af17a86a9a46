"""The Responses fields agent clients send (Codex CLI's first request holds all of these):
`client_metadata`, `include`, `namespace` tools, hosted tools, sealed reasoning."""

from __future__ import annotations

from typing import Any

import pytest

from cacheproxy.edge.apis.responses import fields as responses_fields
from cacheproxy.edge.apis.responses.request import translate
from cacheproxy.edge.apis.responses.tools import seal, unseal
from cacheproxy.errors import InvalidRequest, Unsupported
from tests.unit.keys.test_tools import key

ASK = {"input": "Hi"}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn an agent.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "task": {"type": "string"}}, "required": ["task"]}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1",
          "description": "Tools for spawning and managing sub-agents.", "tools": [SPAWN]}


def chat_key(body: dict[str, Any]) -> str:
    return key(translate(body)[0])


def test_client_metadata_is_passed_not_keyed() -> None:
    # Codex puts its session, turn and installation ids there: a new one every run.
    meta = {"session_id": "01a237f4", "turn_id": "01a237f5", "x-codex-installation-id": "4b93"}
    assert chat_key({**ASK, "client_metadata": meta}) == chat_key(ASK)
    with pytest.raises(InvalidRequest) as bad:
        translate({**ASK, "client_metadata": "session 1"})
    assert bad.value.param == "client_metadata"


def test_without_the_pass_client_metadata_was_refused() -> None:
    # The control: the field is read by name; a name it does not know is still refused.
    with pytest.raises(Unsupported) as refused:
        translate({**ASK, "client_metadatum": {}})
    assert refused.value.param == "client_metadatum"


@pytest.mark.parametrize("include", [["reasoning.encrypted_content"],
                                     ["file_search_call.results", "web_search_call.action.sources"],
                                     []])
def test_include_is_honoured_or_moot_and_never_keyed(include: list[str]) -> None:
    chat, echo = translate({**ASK, "include": include})
    assert key(chat) == chat_key(ASK)
    assert echo.encrypted == ("reasoning.encrypted_content" in include)


@pytest.mark.parametrize(("include", "error"), [
    (["message.output_text.logprobs"], Unsupported),
    (["reasoning.decrypted_content"], InvalidRequest),
    ("reasoning.encrypted_content", InvalidRequest),
])
def test_an_include_value_not_served_is_a_400_naming_include(
        include: object, error: type[InvalidRequest]) -> None:
    with pytest.raises(error) as refused:
        translate({**ASK, "include": include})
    assert refused.value.param == "include" and type(refused.value) is error


def test_a_namespace_tool_is_its_functions_by_their_own_names() -> None:
    flat = {**ASK, "tools": [SPAWN]}
    chat, echo = translate({**ASK, "tools": [AGENTS]})
    assert chat["tools"] == translate(flat)[0]["tools"]
    assert key(chat) == chat_key(flat)  # the same prompt: one entry
    assert echo.namespaces == {"spawn_agent": "multi_agent_v1"}
    assert translate(flat)[1].namespaces == {}
    # The namespace's description reaches no prompt: it is not keyed.
    assert chat_key({**ASK, "tools": [{**AGENTS, "description": "Other."}]}) == key(chat)


@pytest.mark.parametrize(("tools", "param"), [
    ([AGENTS, SPAWN], "tools"),  # one name twice once flattened
    ([{**AGENTS, "tools": [{"type": "custom", "name": "apply_patch"}]}],
     "tools[0].tools[0].type"),
    ([{**AGENTS, "tools": []}], "tools[0].tools"),
    ([{**AGENTS, "name": None}], "tools[0].name"),
])
def test_a_namespace_that_cannot_be_flattened_is_a_400(
        tools: list[Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        translate({**ASK, "tools": tools})
    assert refused.value.param == param


def test_web_search_is_refused_with_how_to_turn_it_off_in_codex() -> None:
    with pytest.raises(Unsupported) as refused:
        translate({**ASK, "tools": [SPAWN, {"type": "web_search", "external_web_access": False}]})
    assert refused.value.param == "tools[1].type"
    assert 'web_search = "disabled"' in refused.value.message
    with pytest.raises(Unsupported) as hosted:
        translate({**ASK, "tools": [{"type": "code_interpreter"}]})
    assert "hosted tool" in hosted.value.message and "web_search" not in hosted.value.message


def test_sealed_reasoning_round_trips_and_a_foreign_seal_is_a_400() -> None:
    thought = "The user says hello. 🦊"
    assert unseal(seal(thought), "x") == thought
    history = [{"role": "user", "content": "Hi"},
               {"type": "reasoning", "summary": [], "encrypted_content": seal(thought)},
               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    plain = [*history[:1], {"type": "reasoning", "summary": [],
                            "content": [{"type": "reasoning_text", "text": thought}]},
             *history[2:]]
    chat, _ = translate({"input": history})
    assert chat["messages"][1]["reasoning_content"] == thought
    assert key(chat) == chat_key({"input": plain})
    for foreign in ("gAAAAABo-openai", 7):
        history[1]["encrypted_content"] = foreign
        with pytest.raises(InvalidRequest) as refused:
            translate({"input": history})
        assert refused.value.param == "input[1].encrypted_content"


# Every field of a Responses request, by its decision (cacheproxy/edge/apis/responses/fields.py).

def test_every_field_the_sdk_defines_has_a_decision() -> None:
    from openai.types.responses import response_create_params as params

    typed = params.ResponseCreateParamsStreaming
    sdk = typed.__required_keys__ | typed.__optional_keys__
    decided = responses_fields.TRANSLATED | responses_fields.PASSED | set(responses_fields.REFUSED)
    assert sdk - decided == set()


@pytest.mark.parametrize("extra", [
    {"user": "u"}, {"safety_identifier": "s"}, {"prompt_cache_key": "k"},
    {"service_tier": "flex"}, {"prompt_cache_retention": "24h"},
    {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}, {"metadata": {"a": "b"}},
    {"store": False}, {"background": False}, {"truncation": "disabled"},
    {"stream_options": {"include_obfuscation": False}}, {"include": []},
    {"client_metadata": {"session_id": "1"}}, {"stream": True},
])
def test_a_passed_field_changes_no_key(extra: dict[str, Any]) -> None:
    assert chat_key({**ASK, **extra}) == chat_key(ASK)


@pytest.mark.parametrize("reasoning", [
    {"context": "auto"}, {"mode": "standard"}, {"summary": "none"}, {"summary": None},
    {"context": None, "mode": None, "generate_summary": None},
])
def test_a_moot_value_is_accepted_and_changes_no_key(reasoning: dict[str, Any]) -> None:
    chat, echo = translate({**ASK, "reasoning": reasoning})
    assert key(chat) == chat_key(ASK) and not echo.summary


@pytest.mark.parametrize("extra", [
    {"reasoning": {"effort": "none"}}, {"max_output_tokens": 16},
    {"instructions": "Be brief."}, {"chat_template_kwargs": {"enable_thinking": False}},
])
def test_an_applied_field_is_keyed(extra: dict[str, Any]) -> None:
    # The control of the two above: the same comparison tells a field that is applied.
    assert chat_key({**ASK, **extra}) != chat_key(ASK)


@pytest.mark.parametrize(("form", "chat"), [
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "n", "strict": True, "description": "d",
      "schema": {"type": "object"}},
     {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "description": "d",
                                             "schema": {"type": "object"}}}),
])
def test_text_format_is_chat_s_response_format(form: dict[str, Any],
                                               chat: dict[str, Any]) -> None:
    # (Keyed as chat keys it: tests/unit/keys/test_structured_keys.py.)
    translated, echo = translate({**ASK, "text": {"format": form}})
    assert translated["response_format"] == chat and echo.text_format == form
    assert "response_format" not in translate({**ASK, "text": {"format": {"type": "text"}}})[0]


@pytest.mark.parametrize(("reasoning", "summary"), [
    ({"summary": "auto"}, True), ({"summary": "detailed"}, True),
    ({"generate_summary": "concise"}, True),  # the deprecated spelling, no longer ignored
    ({"summary": "none"}, False), ({}, False),
])
def test_a_summary_asked_is_given_in_any_spelling(reasoning: dict[str, Any],
                                                  summary: bool) -> None:
    chat, echo = translate({**ASK, "reasoning": reasoning})
    assert echo.summary is summary and key(chat) == chat_key(ASK)  # rendered, not keyed
    assert echo.reasoning["summary"] == (reasoning.get("summary")
                                         or reasoning.get("generate_summary"))


@pytest.mark.parametrize(("extra", "param"), [
    *[({name: "x"}, name) for name in ("previous_response_id", "conversation", "prompt")],
    ({"background": True}, "background"), ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"moderation": {"model": "m"}}, "moderation"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"store": True}, "store"), ({"truncation": "auto"}, "truncation"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"reasoning": {"context": "all_turns"}}, "reasoning.context"),
    ({"reasoning": {"mode": "pro"}}, "reasoning.mode"),
    ({"reasoning": {"budget": 10}}, "reasoning.budget"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "text"}, "language": "en"}}, "text.language"),
    ({"text": {"format": {"type": "text", "strict": True}}}, "text.format.strict"),
    ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"},
                          "json_schema": {}}}}, "text.format.json_schema"),
    ({"tool_choice": {"type": "function", "name": "spawn_agent", "strict": True},
      "tools": [SPAWN]}, "tool_choice.strict"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
])
def test_a_field_not_served_is_refused_by_its_path(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(Unsupported) as refused:
        translate({**ASK, **extra})
    assert refused.value.param == param and refused.value.code == "unsupported_parameter"


@pytest.mark.parametrize(("extra", "param"), [
    ({"user": 7}, "user"), ({"prompt_cache_key": ["k"]}, "prompt_cache_key"),
    ({"prompt_cache_options": "24h"}, "prompt_cache_options"), ({"store": "no"}, "store"),
    ({"background": "no"}, "background"),
    ({"reasoning": {"summary": "short"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": ["auto"]}}, "reasoning.generate_summary"),
    ({"reasoning": {"effort": ["high"]}}, "reasoning.effort"),
    ({"text": {"format": {"type": ["text"]}}}, "text.format.type"),
])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        translate({**ASK, **extra})
    assert refused.value.param == param


def test_effort_max_is_xhigh_in_both_apis() -> None:
    # openai's ReasoningEffort has "max": the most a template can be asked, "xhigh" (as the
    # Messages API's `max` is); one key for the two spellings, the request's echoed as asked.
    chat, echo = translate({**ASK, "reasoning": {"effort": "max"}})
    assert key(chat) == chat_key({**ASK, "reasoning": {"effort": "xhigh"}})
    assert echo.reasoning["effort"] == "max"
    chat_max = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "max"}
    assert key(chat_max) == key(chat) == key({**chat_max, "reasoning_effort": "xhigh"})
    # The control: another level is another key.
    assert chat_key({**ASK, "reasoning": {"effort": "high"}}) != key(chat)


@pytest.mark.parametrize("effort", ["maximum", "MAX", ""])
def test_an_effort_there_is_not_is_a_400_listing_those_there_are(effort: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        translate({**ASK, "reasoning": {"effort": effort}})
    assert refused.value.param == "reasoning.effort"
    assert all(level in refused.value.message for level in ("minimal", "xhigh", "max"))
