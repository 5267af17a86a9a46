"""The Responses API over the same cache: the openai SDK's `responses.create` (whole and
streamed, every event checked against the SDK's own types), one entry shared with the
equivalent chat completion, and the OpenAI Agents SDK running a tool-calling agent."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.conftest import Proxy, ProxyFactory
from tests.e2e.test_tool_calling import WEATHER

MODEL = "cacheproxy-demo"
EVENT = TypeAdapter(ResponseStreamEvent)
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # a Responses function tool


async def _create(proxy: Proxy, **kw: Any) -> tuple[Any, dict[str, str]]:
    raw = await proxy.client.responses.with_raw_response.create(model=MODEL, **kw)
    return raw.parse(), dict(raw.headers)


async def _events(proxy: Proxy, body: dict[str, Any]) -> tuple[list[Any], dict[str, str]]:
    """A streamed response read off the wire, every event parsed with the SDK's types."""
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/responses", json={"model": MODEL, **body, "stream": True}) as resp:
        raw = await resp.read()
        headers = dict(resp.headers)
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        kind, data = block.split("\n", 1)
        event = EVENT.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        events.append(event)
    return events, headers


async def test_responses_miss_then_hit_and_one_entry_with_chat(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    first, h1 = await _create(proxy, input="What does the fox eat?")
    second, h2 = await _create(proxy, input="What does the fox eat?")
    assert (h1["x-cache"], h2["x-cache"]) == ("MISS", "HIT")
    assert first.output_text and first.output_text == second.output_text
    assert first.status == "completed" and first.id != second.id
    assert second.usage.input_tokens_details.cached_tokens == second.usage.input_tokens
    assert [i.type for i in first.output] == ["reasoning", "message"]  # it thinks by default
    chat = await proxy.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What does the fox eat?"}])
    assert chat.headers["x-cache"] == "HIT"
    assert chat.headers["x-cache-key"] == h1["x-cache-key"]
    assert chat.parse().choices[0].message.content == first.output_text
    # And the other way round: a chat entry answers the Responses call.
    await proxy.client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where does the owl live?"}])
    parts = [{"type": "input_text", "text": "Where does the owl live?"}]
    answer, headers = await _create(proxy, instructions="Answer briefly.",
                                    input=[{"role": "user", "content": parts}])
    assert headers["x-cache"] == "HIT" and answer.output_text


async def test_streamed_events_validate_and_a_streamed_hit_replays_them(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    body = {"input": "Tell me about the cat."}
    miss, h1 = await _events(proxy, body)
    hit, h2 = await _events(proxy, body)
    assert (h1["X-Cache"], h2["X-Cache"]) == ("MISS", "HIT")
    kinds = [e.type for e in miss]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for needed in ("response.output_item.added", "response.content_part.added",
                   "response.output_text.delta", "response.output_text.done",
                   "response.output_item.done", "response.reasoning_text.delta"):
        assert needed in kinds
    assert [e.sequence_number for e in miss] == list(range(len(miss)))
    strip = [e.model_dump(exclude={"response"}) for e in miss]
    assert strip == [e.model_dump(exclude={"response"}) for e in hit]
    text = "".join(e.delta for e in miss if e.type == "response.output_text.delta")
    whole, _ = await _create(proxy, input="Tell me about the cat.")
    assert text == whole.output_text == miss[-1].response.output_text
    # The SDK's own stream reader takes the same events.
    async with proxy.client.responses.stream(model=MODEL, input="Tell me about the cat.") as s:
        final = await s.get_final_response()
    assert final.output_text == whole.output_text


async def test_function_calls_through_responses(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call, _ = await _create(proxy, input=ask, tools=[FLAT_WEATHER])
    (fc,) = [i for i in call.output if i.type == "function_call"]
    assert fc.name == "get_weather" and list(json.loads(fc.arguments)) == ["city"]
    chat = await proxy.client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER])
    assert chat.choices[0].message.tool_calls[0].id == fc.call_id  # one entry, one id
    streamed, _ = await _events(proxy, {"input": ask, "tools": [FLAT_WEATHER]})
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [(fc.name, fc.arguments)]
    follow = [*ask, {"type": "function_call", "call_id": fc.call_id, "name": fc.name,
                     "arguments": fc.arguments},
              {"type": "function_call_output", "call_id": fc.call_id, "output": "foggy, 8 C"}]
    answer, _ = await _create(proxy, input=follow, tools=[FLAT_WEATHER])
    assert "foggy" in answer.output_text


async def test_max_output_tokens_is_an_incomplete_response(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    cut, _ = await _create(proxy, input="Tell me a story about the wolf.", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ({"tools": [{**FLAT_WEATHER, "returns": "a report"}]}, "tools[0].returns"),
    ({"reasoning": {"effort": "low", "context": "all_turns"}}, "reasoning.context"),
])
async def test_state_and_hosted_tools_are_refused_not_dropped(
    make_proxy: ProxyFactory, extra: dict[str, Any], param: str
) -> None:
    proxy = await make_proxy()
    with pytest.raises(openai.BadRequestError) as info:
        await proxy.client.responses.create(model=MODEL, **{"input": "Hi", **extra})
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert body["code"] == "unsupported_parameter"


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_output_tokens": 1 << 40}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "n",
                          "schema": {"type": "object", "properties": 3}}}}, "text.format.schema"),
    ({"tools": [{**FLAT_WEATHER, "parameters": {"type": "string"}}]}, "tools[0].parameters"),
])
async def test_a_chat_check_names_the_responses_path(
    make_proxy: ProxyFactory, extra: dict[str, Any], param: str
) -> None:
    # The request is checked as its chat translation; its error names the Responses field.
    proxy = await make_proxy()
    with pytest.raises(openai.BadRequestError) as info:
        await proxy.client.responses.create(model=MODEL, **{"input": "Hi", **extra})
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param and f"{param}" in body["message"]


async def test_an_openai_agents_agent_runs_a_tool_turn_and_its_rerun_is_cached(
    make_proxy: ProxyFactory
) -> None:
    from agents import Agent, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    proxy = await make_proxy()
    looked_up: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        looked_up.append(city)
        return "windy, 15 degrees"

    model = OpenAIResponsesModel(model=MODEL, openai_client=proxy.client)
    agent = Agent(name="weather", instructions="Answer briefly.", model=model,
                  tools=[get_weather])
    first = await Runner.run(agent, "What is the weather in London?")
    generated = proxy.generations
    second = await Runner.run(agent, "What is the weather in London?")
    # The tool ran once a run, with the same (model-chosen) city; the answer is text.
    assert len(looked_up) == 2 and looked_up[0] == looked_up[1]
    assert first.final_output and second.final_output == first.final_output
    assert proxy.generations == generated  # the rerun's two model calls were HITs


async def test_codex_style_namespace_tools_and_sealed_reasoning(make_proxy: ProxyFactory) -> None:
    # Codex offers tools inside a namespace and sends back the reasoning items it got as
    # `encrypted_content` only (store: false). The call names its namespace (as the SDK's
    # types have it); the sealed thought gives the next turn the very prompt the thought as
    # text gives (a HIT on its entry); without the thought the prompt differs (the control).
    proxy = await make_proxy()
    tools = [{"type": "namespace", "name": "world", "description": "The demo world.",
              "tools": [FLAT_WEATHER]}]
    first, _ = await _create(proxy, input=ask_paris(), tools=tools,
                             include=["reasoning.encrypted_content"], store=False)
    thought, call = first.output[0], first.output[-1]
    assert thought.type == "reasoning" and thought.encrypted_content
    assert call.type == "function_call" and (call.name, call.namespace) == ("get_weather",
                                                                           "world")
    streamed, _ = await _events(proxy, {"input": ask_paris(), "tools": tools,
                                        "include": ["reasoning.encrypted_content"]})
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in first.output]
    back = {"type": "function_call", "call_id": call.call_id, "name": call.name,
            "namespace": call.namespace, "arguments": call.arguments}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 20"}
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": thought.encrypted_content}
    as_text = {"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": thought.content[0].text}]}
    keys = []
    for item in (sealed, as_text, None):
        history = [*ask_paris(), *([item] if item else []), back, result]
        _, headers = await _create(proxy, input=history, tools=tools)
        keys.append((headers["x-cache"], headers["x-cache-key"]))
    assert keys[0][0] == "MISS" and keys[1] == ("HIT", keys[0][1])
    assert keys[2][1] != keys[0][1]


def ask_paris() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_the_stream_opens_the_items_the_final_response_holds(finish: str) -> None:
    # A thought, text, a call, more text (and a second thought): the items are the runs in
    # the order they came, each with an id of its own, in the stream and in the response.
    from cacheproxy.edge.apis import replay
    from cacheproxy.edge.apis.frame import Frame
    from cacheproxy.edge.apis.responses.render import ResponsesStream
    from cacheproxy.keys.canonical import Delivery
    from cacheproxy.keys.codec import Chunk, Output, ToolCallOut

    call = ToolCallOut(0, "get_weather", '{"city": "Lima"}')
    chunks = (Chunk("", (1,), reasoning="I look"), Chunk("", (2,), reasoning=" it up."),
              Chunk("Let me", (3,)), Chunk(" see.", (4,)), Chunk("", (5,), tool_calls=(call,)),
              Chunk("", (6,), reasoning="Done."), Chunk("It is", (7,)))
    output = Output(chunks, finish, 10, 7)
    frame = Frame("resp_1", 0, MODEL, "fp", Delivery(True, False, 1, MODEL,
                  api="responses"), False, False, key="ns/abc")
    streamed = replay(ResponsesStream(frame), output)
    events = [EVENT.validate_json(line[6:]) for line in streamed.split(b"\n")
              if line.startswith(b"data: ")]
    done = [e.item.model_dump(exclude_none=True) for e in events
            if e.type == "response.output_item.done"]
    final = events[-1].response.model_dump(exclude_none=True)["output"]
    assert done == final
    assert [i["type"] for i in final] == ["reasoning", "message", "function_call", "reasoning",
                                          "message"]
    assert len({i["id"] for i in final}) == 5
    assert final[1]["content"][0]["text"] == "Let me see." and final[1]["status"] == "completed"
    assert final[-1]["status"] == ("incomplete" if finish == "length" else "completed")
    assert events[-1].type == ("response.incomplete" if finish == "length"
                               else "response.completed")
