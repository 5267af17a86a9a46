"""The keys of a Responses `input` item and of its parts: every key openai's types define is
applied or passed (what clients echo back: `id`, `status`, `phase`...), any other is a 400
naming `input[i].key` or `input[i].content[j].key`."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from openai.types.responses import (
    easy_input_message_param,
    response_function_tool_call_param,
    response_input_item_param,
    response_input_text_content_param,
    response_input_text_param,
    response_output_message_param,
    response_output_text_param,
    response_reasoning_item_param,
)

from cacheproxy.edge.apis.responses import items as responses_items
from cacheproxy.edge.apis.responses.tools import seal
from cacheproxy.errors import InvalidRequest, Unsupported
from tests.unit.edge.test_responses_fields import chat_key


def _keys(*typed: Any) -> frozenset[str]:
    return frozenset().union(*(t.__required_keys__ | t.__optional_keys__ for t in typed))


def test_the_keys_known_are_the_sdks() -> None:
    # An SDK that defines a new key fails here, so that its decision is taken, not skipped.
    items = responses_items.ITEM_KEYS
    assert items["message"] == _keys(easy_input_message_param.EasyInputMessageParam,
                                     response_input_item_param.Message,
                                     response_output_message_param.ResponseOutputMessageParam)
    assert items["function_call"] == _keys(
        response_function_tool_call_param.ResponseFunctionToolCallParam)
    assert items["function_call_output"] == _keys(response_input_item_param.FunctionCallOutput)
    assert items["reasoning"] == _keys(response_reasoning_item_param.ResponseReasoningItemParam)
    parts = responses_items.PART_KEYS
    assert parts["input_text"] == _keys(
        response_input_text_param.ResponseInputTextParam,
        response_input_text_content_param.ResponseInputTextContentParam)
    assert parts["output_text"] == _keys(response_output_text_param.ResponseOutputTextParam)
    thoughts = responses_items.THOUGHT_KEYS
    assert thoughts["summary"]["summary_text"] == _keys(response_reasoning_item_param.Summary)
    assert thoughts["content"]["reasoning_text"] == _keys(response_reasoning_item_param.Content)


# A tool turn as Codex 0.171 sends it back (captured off the wire, texts shortened): every
# item with its id, the output items as they were given (status, phase, annotations...).
CODEX = [
    {"type": "message", "id": "msg_1abd", "role": "developer",
     "content": [{"type": "input_text", "text": "You are Codex."}]},
    {"type": "message", "id": "msg_01a2", "role": "user",
     "content": [{"type": "input_text", "text": "Say hello."}]},
    {"type": "reasoning", "id": "rs_0", "summary": [{"type": "summary_text", "text": "Think."}],
     "content": [{"type": "reasoning_text", "text": "I think."}],
     "encrypted_content": seal("I think.")},
    {"type": "message", "status": "completed", "id": "msg_a", "role": "assistant",
     "content": [{"type": "output_text", "text": "Running.", "annotations": []}],
     "phase": "commentary"},
    {"type": "function_call", "status": "completed", "id": "fc_0", "name": "exec_command",
     "arguments": '{"cmd":"echo hi"}', "call_id": "call_0"},
    {"type": "function_call_output", "id": "fco_01a2", "call_id": "call_0", "output": "hi\n"},
    {"type": "message", "status": "completed", "id": "msg_b", "role": "assistant",
     "content": [{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}],
     "phase": "final_answer"},
    {"type": "message", "id": "msg_01a3", "role": "user",
     "content": [{"type": "input_text", "text": "Bye."}]},
]
_PASSED = ("id", "status", "phase", "annotations", "logprobs", "encrypted_content")


def _bare(value: Any) -> Any:
    """The history without what is passed (the sealed thought is its content again)."""
    if isinstance(value, list):
        return [_bare(v) for v in value]
    if isinstance(value, dict):
        return {k: _bare(v) for k, v in value.items() if k not in _PASSED}
    return value


def test_codex_s_history_is_read_and_its_echoed_keys_are_not_keyed() -> None:
    assert chat_key({"input": CODEX}) == chat_key({"input": _bare(CODEX)})


@pytest.mark.parametrize(("index", "extra"), [
    (0, {"status": "in_progress"}), (3, {"phase": None}), (3, {"id": None}),
    (4, {"namespace": "tools"}), (4, {"caller": {"type": "direct"}}), (4, {"caller": None}),
    (5, {"name": "exec_command", "namespace": "tools", "status": "incomplete"}),
    (5, {"caller": {"type": "direct"}}), (2, {"status": "completed"}),
])
def test_a_passed_or_moot_item_key_changes_no_key(index: int, extra: dict[str, Any]) -> None:
    history = copy.deepcopy(CODEX)
    history[index] |= extra
    assert chat_key({"input": history}) == chat_key({"input": CODEX})


@pytest.mark.parametrize("part", [
    {"prompt_cache_breakpoint": {"mode": "explicit"}}, {"prompt_cache_breakpoint": None}])
def test_a_passed_part_key_changes_no_key(part: dict[str, Any]) -> None:
    history = copy.deepcopy(CODEX)
    history[1]["content"][0] |= part
    history[5]["output"] = [{"type": "input_text", "text": "hi\n", **part}]
    assert chat_key({"input": history}) == chat_key({"input": CODEX})


@pytest.mark.parametrize(("index", "path", "value"), [
    (1, ("content", 0, "text"), "Say bye."), (3, ("role",), "user"),
    (4, ("arguments",), '{"cmd":"echo ho"}'), (5, ("output",), "ho\n"),
    (2, ("content", 0, "text"), "I think twice."),
])
def test_an_applied_key_is_keyed(index: int, path: tuple[Any, ...], value: Any) -> None:
    # The control of the passed ones: the same comparison tells a key that changes the prompt.
    history = copy.deepcopy(CODEX)
    history[2].pop("encrypted_content")  # (a sealed thought is read before its content)
    plain = chat_key({"input": history})
    target = history[index]
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    assert chat_key({"input": history}) != plain


@pytest.mark.parametrize(("index", "extra", "param"), [
    (0, {"foo": 1}, "input[0].foo"),
    (3, {"end_turn": True}, "input[3].end_turn"),
    (4, {"function": {"name": "x"}}, "input[4].function"),
    (5, {"is_error": True}, "input[5].is_error"),
    (2, {"signature": "s"}, "input[2].signature"),
    (4, {"caller": {"type": "direct", "caller_id": "p"}}, "input[4].caller.caller_id"),
    (4, {"caller": {"type": "program", "caller_id": "p"}}, "input[4].caller"),
    (5, {"caller": {"type": "program", "caller_id": "p"}}, "input[5].caller"),
])
def test_an_unknown_item_key_is_refused_by_its_path(
        index: int, extra: dict[str, Any], param: str) -> None:
    history = copy.deepcopy(CODEX)
    history[index] |= extra
    with pytest.raises(Unsupported) as refused:
        chat_key({"input": history})
    assert refused.value.param == param and param in refused.value.message


@pytest.mark.parametrize(("index", "part", "param"), [
    (1, {"bar": 1}, "input[1].content[0].bar"),
    (3, {"cache_control": {"type": "ephemeral"}}, "input[3].content[0].cache_control"),
    (1, {"annotations": []}, "input[1].content[0].annotations"),  # an output_text key
    (2, {"signature": "s"}, "input[2].content[0].signature"),
])
def test_an_unknown_part_key_is_refused_by_its_path(
        index: int, part: dict[str, Any], param: str) -> None:
    history = copy.deepcopy(CODEX)
    history[index]["content"][0] |= part
    with pytest.raises(Unsupported) as refused:
        chat_key({"input": history})
    assert refused.value.param == param


def test_a_function_output_s_parts_are_checked_by_their_path() -> None:
    history = copy.deepcopy(CODEX)
    history[5]["output"] = [{"type": "input_text", "text": "hi\n", "bar": 1}]
    with pytest.raises(Unsupported) as refused:
        chat_key({"input": history})
    assert refused.value.param == "input[5].output[0].bar"


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"},
     "input[1].content[0].type"),
    ({"type": "input_file", "file_id": "f"}, "input[1].content[0].type"),
    ("Say hello.", "input[1].content[0].type"),
    ({"type": ["input_text"], "text": "x"}, "input[1].content[0].type"),  # a 400, not a 500
])
def test_a_part_that_is_not_text_is_refused_by_its_type(part: Any, param: str) -> None:
    history = copy.deepcopy(CODEX)
    history[1]["content"] = [part]
    with pytest.raises(Unsupported) as refused:
        chat_key({"input": history})
    assert refused.value.param == param


@pytest.mark.parametrize(("index", "extra", "param"), [
    (0, {"id": 7}, "input[0].id"), (3, {"status": "done"}, "input[3].status"),
    (3, {"phase": ["commentary"]}, "input[3].phase"), (4, {"namespace": 1}, "input[4].namespace"),
    (5, {"name": {}}, "input[5].name"), (4, {"caller": "direct"}, "input[4].caller.type"),
    (2, {"summary": "Think."}, "input[2].summary"),
    (2, {"content": [{"type": "summary_text", "text": "x"}]}, "input[2].content[0].type"),
    (2, {"content": [], "summary": [{"type": "summary_text"}]}, "input[2].summary[0].text"),
    (2, {"content": [{"type": {}, "text": "x"}]}, "input[2].content[0].type"),
    (0, {"type": ["message"]}, "input[0].type"),
])
def test_a_key_of_the_wrong_type_is_a_400_naming_it(
        index: int, extra: dict[str, Any], param: str) -> None:
    history = copy.deepcopy(CODEX)
    history[index] |= extra
    history[2].pop("encrypted_content")
    with pytest.raises(InvalidRequest) as refused:
        chat_key({"input": history})
    assert refused.value.param == param
