"""The Responses fields agent clients send (Codex CLI's first request holds all of these):
`client_metadata`, `include`, `namespace` tools, hosted tools, sealed reasoning."""

from __future__ import annotations

from typing import Any

import pytest

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
