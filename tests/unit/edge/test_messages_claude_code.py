"""What Claude Code 2.1 sends by default is accepted faithfully (#32): `context_management`'s
clear_thinking applied to the turns, deferred tools kept out of the prompt, a system turn's
own `output_config.effort` governing the answer, and its per-run ids never keyed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cacheproxy.edge.apis.frame import Frame
from cacheproxy.edge.apis.messages.render import body
from cacheproxy.edge.apis.messages.request import parse_messages
from cacheproxy.errors import InvalidRequest
from cacheproxy.keys.canonical import Delivery
from cacheproxy.keys.codec import Chunk, Output
from policies.sampling import SamplingMode
from tests.unit.edge.test_messages_request import ASK, DEFAULTS, SCHEMA, chat, key, messages

THOUGHT = [ASK, {"role": "assistant", "content": [
    {"type": "thinking", "thinking": "First thought.", "signature": "s1"},
    {"type": "text", "text": "Foggy."}]},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Second thought.", "signature": "s2"},
        {"type": "text", "text": "Rain."}]},
    {"role": "user", "content": "And the day after?"}]


def _twin_turns(first: str | None, second: str | None) -> list[dict[str, Any]]:
    def reply(text: str, thought: str | None) -> dict[str, Any]:
        return {"role": "assistant", "content": text,
                **({"reasoning_content": thought} if thought else {})}
    return [ASK, reply("Foggy.", first), {"role": "user", "content": "And tomorrow?"},
            reply("Rain.", second), {"role": "user", "content": "And the day after?"}]


def _clearing(keep: object = None) -> dict[str, Any]:
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
    if keep is not None:
        edit["keep"] = keep
    return {"edits": [edit]}


@pytest.mark.parametrize(("keep", "first", "second"), [
    ("all", "First thought.", "Second thought."),  # what Claude Code sends: nothing cleared
    (None, None, "Second thought."),  # Anthropic's default: the last thinking turn kept
    ({"type": "thinking_turns", "value": 0}, None, None),
])
def test_clear_thinking_is_applied_to_the_turns(keep: object, first: str | None,
                                                second: str | None) -> None:
    ours = messages(messages=THOUGHT, context_management=_clearing(keep))
    assert ours.request == chat(messages=_twin_turns(first, second)).request
    # Control: the edit does change the key where it clears something.
    assert (key(ours) == key(messages(messages=THOUGHT))) == (keep == "all")


@pytest.mark.parametrize(("management", "param"), [
    ({"edits": [{"type": "clear_tool_uses_20250919"}]}, "context_management.edits[0].type"),
    ({"edits": [{"type": "clear_thinking_20251015", "keep": 2}]},
     "context_management.edits[0].keep"),
    ({"edits": [{"type": "clear_thinking_20251015", "clear_at_least": 1}]},
     "context_management.edits[0].clear_at_least"),
    ({"edits": "all"}, "context_management.edits"),
    ({"strategy": "x"}, "context_management.strategy"),
])
def test_context_edits_it_cannot_apply_are_refused_by_name(management: dict[str, Any],
                                                           param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        messages(messages=THOUGHT, context_management=management)
    assert refused.value.param == param


SHOWN = {"name": "get_weather", "input_schema": SCHEMA}
DEFERRED = {"name": "CronCreate", "input_schema": SCHEMA, "defer_loading": True}


def test_a_deferred_tool_is_checked_and_not_shown_to_the_model() -> None:
    shown, deferred = SHOWN, DEFERRED
    ours = messages(tools=[shown, deferred])
    assert ours.request == messages(tools=[shown]).request
    assert key(ours) != key(messages(tools=[shown, {**deferred, "defer_loading": False}]))
    with pytest.raises(InvalidRequest) as refused:  # still checked as any tool is
        messages(tools=[shown, {**deferred, "input_schema": {"type": 5}}])
    assert refused.value.param == "tools[1].input_schema"


LATE = {"role": "system", "content": "Now be quick."}


@pytest.mark.parametrize(("tools", "choice", "param", "said"), [
    ([SHOWN, DEFERRED], {"type": "tool", "name": "CronCreate"}, "tool_choice.name",
     "'CronCreate' is a deferred tool (defer_loading true)"),
    ([DEFERRED], {"type": "tool", "name": "CronCreate"}, "tool_choice.name",
     "'CronCreate' is a deferred tool (defer_loading true)"),
    ([SHOWN, DEFERRED], {"type": "tool", "name": "Nowhere"}, "tool_choice.name",
     "'Nowhere' names no tool in 'tools'"),
    ([SHOWN, DEFERRED], {"type": "tool"}, "tool_choice.name", "is required"),
    ([DEFERRED], {"type": "any"}, "tool_choice", "every tool has defer_loading true"),
    ([], {"type": "any"}, "tool_choice", "'any' needs tools"),
])
def test_tool_choice_cannot_force_a_tool_the_model_is_not_shown(
    tools: list[Any], choice: dict[str, Any], param: str, said: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        messages(tools=tools, tool_choice=choice)
    assert refused.value.param == param and said in refused.value.message


@pytest.mark.parametrize(("choice", "mode"), [
    ({"type": "tool", "name": "CronCreate"}, ("function", "CronCreate")),
    ({"type": "any"}, ("required", "")),
])
def test_the_same_tool_choice_forces_a_tool_that_is_shown(choice: dict[str, Any],
                                                          mode: tuple[str, str]) -> None:
    # Control of the refusals above: shown (defer_loading false), the tool can be forced.
    request = messages(tools=[SHOWN, {**DEFERRED, "defer_loading": False}],
                       tool_choice=choice).request
    assert (request.tool_choice, request.tool_name) == mode


def test_a_system_turns_effort_governs_the_answer_asked_now() -> None:
    late = {"role": "system", "content": "Now be quick.", "output_config": {"effort": "low"}}
    ours = messages(messages=[ASK, late], output_config={"effort": "high"})
    twin = chat(messages=[ASK, {"role": "system", "content": "Now be quick."}],
                chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"})
    assert ours.request == twin.request
    earlier = messages(messages=[late, ASK], output_config={"effort": "high"})
    assert earlier.request.template_kwargs == twin.request.template_kwargs  # the last one set
    for turn, param in (({**ASK, "output_config": {"effort": "low"}}, "messages[1].output_config"),
                        ({**late, "output_config": {"format": {}}},
                         "messages[1].output_config.format"),
                        ({**late, "output_config": {"effort": "extreme"}},
                         "messages[1].output_config.effort")):
        with pytest.raises(InvalidRequest) as refused:
            messages(messages=[ASK, turn])
        assert refused.value.param == param


@pytest.mark.parametrize(("body", "param"), [
    # Each turn's effort is checked where it is, not only the last one's.
    ({"messages": [{**LATE, "output_config": {"effort": "extreme"}}, ASK, LATE]},
     "messages[0].output_config.effort"),
    ({"messages": [ASK, {**LATE, "output_config": {"effort": ["low"]}}]},
     "messages[1].output_config.effort"),
    ({"messages": [ASK, {**LATE, "output_config": "low"}]}, "messages[1].output_config"),
    # The request's own is checked even where a turn's governs the answer.
    ({"messages": [ASK, {**LATE, "output_config": {"effort": "low"}}],
      "output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"effort": 3}}, "output_config.effort"),
    ({"output_config": {"effort": ["high"]}}, "output_config.effort"),
])
def test_every_effort_is_checked_and_refused_by_its_path(body: dict[str, Any],
                                                         param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        messages(**body)
    assert refused.value.param == param and f"'{param}'" in refused.value.message
    if param.endswith(".effort"):  # the levels it may be
        assert "'low', 'medium', 'high', 'xhigh', 'max'" in refused.value.message


@pytest.mark.parametrize("effort", ["low", "medium", "high", "xhigh", "max"])
def test_each_of_anthropics_effort_levels_is_accepted(effort: str) -> None:
    turn = {**LATE, "output_config": {"effort": effort}}
    assert messages(messages=[ASK, turn], output_config={"effort": effort}).request == \
        messages(output_config={"effort": effort}, messages=[ASK, LATE]).request


def _claude_code_body(session: str) -> dict[str, Any]:
    """The shape of Claude Code 2.1.332's first request (its texts shortened)."""
    user_id = json.dumps({"device_id": "be2a", "account_uuid": "", "session_id": session})
    return {
        "model": "demo", "max_tokens": 32000, "stream": True,
        "metadata": {"user_id": user_id},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332."},
                   {"type": "text", "text": "You are a Claude agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]},
                     {"role": "system", "content": [
                         {"type": "text", "text": "Today's date is 2026-12-02.",
                          "cache_control": {"type": "ephemeral"}}],
                      "output_config": {"effort": "medium"}}],
        "tools": [{"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA},
                  {"name": "DeferredToolPlaceholder", "description": "Deferred.",
                   "defer_loading": True, "input_schema": {"type": "object", "properties": {}}}],
    }


def test_claude_codes_request_is_accepted_and_its_session_id_is_not_keyed() -> None:
    one, two = (parse_messages(_claude_code_body(s), DEFAULTS, SamplingMode.FORCE_GREEDY)
                for s in ("5420aefc", "bd83efea"))
    assert key(one) == key(two)
    assert [t.name for t in one.request.tools] == ["Bash"]
    dated = _claude_code_body("5420aefc")
    dated["messages"][1]["content"][0]["text"] = "Today's date is 2026-12-03."
    assert key(parse_messages(dated, DEFAULTS, SamplingMode.FORCE_GREEDY)) != key(one)


@pytest.mark.parametrize("display", ["updates", "highlights", "summarized"])
def test_a_shown_thinking_display_is_the_thought_as_generated(display: str) -> None:
    # Claude Code asks for `updates` under --output-format stream-json (and retries twice
    # without it when refused); this server has no summariser, so the thought is shown.
    shown = messages(thinking={"type": "adaptive", "display": display})
    assert shown.request == messages(thinking={"type": "adaptive"}).request
    assert shown.delivery.echo == b""
    omitted = messages(thinking={"type": "adaptive", "display": "omitted"})
    assert omitted.delivery.echo != b""  # control: omitted is told apart
    with pytest.raises(InvalidRequest) as refused:
        messages(thinking={"type": "adaptive", "display": "verbatim"})
    assert refused.value.param == "thinking.display"


def test_an_omitted_thought_comes_back_unsealed_and_keys_as_if_shown() -> None:
    output = Output((Chunk("", (1,), reasoning="Foxes eat mice."), Chunk("Mice.", (2,))),
                    "stop", 10, 2)
    delivery = Delivery(True, False, 1, "demo", api="messages", echo=b'{"omit_thinking": true}')
    reply = body(Frame("msg_1", 0, "demo", "fp", delivery, False, False, key="ns/k"),
                 output)["content"]
    assert reply[0]["thinking"] == ""  # the client is shown no thought
    follow = {"role": "user", "content": "And owls?"}
    ours = messages(messages=[ASK, {"role": "assistant", "content": reply}, follow])
    shown = [{**reply[0], "thinking": "Foxes eat mice.", "signature": "s1"}, reply[1]]
    assert key(ours) == key(messages(messages=[ASK, {"role": "assistant", "content": shown},
                                               follow]))
    assert ours.request == chat(messages=[ASK, {"role": "assistant", "content": "Mice.",
                                                "reasoning_content": "Foxes eat mice."},
                                          follow]).request
    # Control: a signature this server did not seal cannot stand for the thought.
    for signature in ("s1", "cpx1.%%%", reply[0]["signature"][:-2] + "@@"):
        foreign = [{**reply[0], "signature": signature}, reply[1]]
        with pytest.raises(InvalidRequest) as refused:
            messages(messages=[ASK, {"role": "assistant", "content": foreign}, follow])
        assert refused.value.param == "messages[1].content[0].signature"
        assert "signature" in refused.value.message


def test_a_tool_reference_is_refused_with_how_to_turn_tool_search_off() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
            "input": {"query": "select:WebFetch"}}
    found = {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "tool_reference", "tool_name": "WebFetch"}]}
    with pytest.raises(InvalidRequest) as refused:
        messages(messages=[ASK, {"role": "assistant", "content": [call]},
                           {"role": "user", "content": [found]}])
    assert refused.value.param == "messages[2].content[0].content[0].type"
    assert "ENABLE_TOOL_SEARCH=false" in refused.value.message


def test_a_thought_omitted_before_thoughts_were_sealed_goes_on_as_an_empty_thought() -> None:
    # A conversation begun before the seal: the omitted block came back empty under the shown
    # signature's form. It goes on (its lost thought empty, as it keyed then), not a 400.
    follow = {"role": "user", "content": "And owls?"}
    old = [{"type": "thinking", "thinking": "", "signature": "cacheproxy-0123456789abcdef"},
           {"type": "text", "text": "Mice."}]
    went_on = messages(messages=[ASK, {"role": "assistant", "content": old}, follow])
    assert went_on.request == chat(messages=[ASK, {"role": "assistant", "content": "Mice."},
                                             follow]).request
    # Control: another server's signature on an empty thought is still refused.
    with pytest.raises(InvalidRequest):
        messages(messages=[ASK, {"role": "assistant", "content": [
            {**old[0], "signature": "EqQBCkgIAhABGAIiQ"}, old[1]]}, follow])
