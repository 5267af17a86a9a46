"""Tool calling, tool history, tool_choice and reasoning end to end: the real demo model, real
HTTP, the real openai SDK. The demo model was trained to call `get_weather(city)` when it is
offered and asked about the weather, to answer from the tool's result, and to think first
when its template opens a thought (`enable_thinking`, on by default, as mlx-lm has it), and
it copies from the prompt: the city into the call, the tool's result into the answer, the
animal asked about into the answer."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import Proxy, ProxyFactory

MODEL = "cacheproxy-demo"
CITIES = ("Paris", "London", "Tokyo", "Berlin", "Cairo", "Lima")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def ask(city: str = "Paris") -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"What is the weather in {city}?"}]


async def create(proxy: Proxy, **kw: Any) -> tuple[Any, dict[str, str]]:
    """A completion through the SDK, with the response headers."""
    raw = await proxy.client.chat.completions.with_raw_response.create(model=MODEL, **kw)
    return raw.parse(), dict(raw.headers)


async def stream(proxy: Proxy, **kw: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A streamed completion accumulated as a client does: text, reasoning, tool calls."""
    raw = await proxy.client.chat.completions.with_raw_response.create(
        model=MODEL, stream=True, **kw)
    text, reasoning, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    async for chunk in raw.parse():
        delta = chunk.choices[0].delta
        text += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        for call in delta.tool_calls or []:
            into = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            into["id"] += call.id or ""
            into["name"] += call.function.name or ""
            into["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return ({"text": text, "reasoning": reasoning, "finish": finish,
             "calls": [calls[i] for i in sorted(calls)]}, dict(raw.headers))


def calls_of(completion: Any) -> list[dict[str, str]]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in completion.choices[0].message.tool_calls or []]


async def test_the_weather_question_is_one_call_then_a_hit_with_the_same_ids(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    for city in CITIES:
        miss, h1 = await create(proxy, messages=ask(city), tools=[WEATHER])
        hit, h2 = await create(proxy, messages=ask(city), tools=[WEATHER])
        assert (h1["x-cache"], h2["x-cache"]) == ("MISS", "HIT")
        (call,) = calls_of(miss)
        assert call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": city}
        assert call["id"].startswith("call_")
        assert calls_of(hit) == calls_of(miss)  # ids included
        assert miss.choices[0].finish_reason == hit.choices[0].finish_reason == "tool_calls"
        assert miss.model_dump_json(exclude={"id", "created", "usage"}) == \
            hit.model_dump_json(exclude={"id", "created", "usage"})


async def test_stream_and_whole_answers_carry_the_same_calls_and_a_streamed_hit_replays_them(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    first, h1 = await stream(proxy, messages=ask("Tokyo"), tools=[WEATHER])
    again, h2 = await stream(proxy, messages=ask("Tokyo"), tools=[WEATHER])
    whole, h3 = await create(proxy, messages=ask("Tokyo"), tools=[WEATHER])
    assert (h1["x-cache"], h2["x-cache"], h3["x-cache"]) == ("MISS", "HIT", "HIT")
    assert first == again
    assert first["calls"] == calls_of(whole) and first["finish"] == "tool_calls"
    assert first["text"] == (whole.choices[0].message.content or "")
    assert first["reasoning"] == (whole.choices[0].message.model_extra or {}).get("reasoning", "")


async def test_a_regeneration_gives_the_same_ids(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    first, _ = await create(proxy, messages=ask("Cairo"), tools=[WEATHER])
    raw = await proxy.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask("Cairo"), tools=[WEATHER],
        extra_headers={"Cache-Control": "no-cache"})
    assert raw.headers["x-cache-revalidated"] == "match"
    assert calls_of(raw.parse()) == calls_of(first)


async def test_the_two_turn_loop_answers_from_the_tools_result(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    messages = ask("Berlin")
    call, _ = await create(proxy, messages=messages, tools=[WEATHER])
    message = call.choices[0].message
    messages.append(message.model_dump(exclude_none=True))  # as SDK users append it
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                     "content": json.dumps({"forecast": "snowy", "temperature": 2})})
    answer, headers = await create(proxy, messages=messages, tools=[WEATHER])
    text = answer.choices[0].message.content
    assert headers["x-cache"] == "MISS" and answer.choices[0].finish_reason == "stop"
    assert text and not answer.choices[0].message.tool_calls
    again, headers = await create(proxy, messages=messages, tools=[WEATHER])
    assert headers["x-cache"] == "HIT" and again.choices[0].message.content == text


async def test_tool_choice_none_required_and_named(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    none, _ = await create(proxy, messages=ask(), tools=[WEATHER], tool_choice="none")
    assert not none.choices[0].message.tool_calls and none.choices[0].message.content
    assert none.choices[0].finish_reason == "stop"
    animal = [{"role": "user", "content": "What does the owl eat?"}]
    free, _ = await create(proxy, messages=animal, tools=[WEATHER])
    assert not free.choices[0].message.tool_calls  # nothing to look up: it answers
    forced, _ = await create(proxy, messages=animal, tools=[WEATHER], tool_choice="required")
    assert [c["name"] for c in calls_of(forced)] == ["get_weather"]
    named, _ = await create(proxy, messages=ask("Lima"), tools=[WEATHER, TIME],
                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = calls_of(named)
    assert call["name"] == "get_time" and list(json.loads(call["arguments"])) == ["city"]


async def test_parallel_tool_calls_false_stops_after_the_first_call(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    both = [{"role": "user", "content": "What is the weather in Paris and London?"}]
    many, _ = await create(proxy, messages=both, tools=[WEATHER])
    one, _ = await create(proxy, messages=both, tools=[WEATHER], parallel_tool_calls=False)
    assert calls_of(many) and {c["name"] for c in calls_of(many)} == {"get_weather"}
    first = [(c["name"], c["arguments"]) for c in calls_of(many)][:1]
    assert [(c["name"], c["arguments"]) for c in calls_of(one)] == first  # (ids: other keys)
    assert one.choices[0].finish_reason == "tool_calls"


async def test_thinking_on_and_off_are_two_entries_with_the_reasoning_apart(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    question = [{"role": "user", "content": "What does the fox eat?"}]
    on, h_on = await create(proxy, messages=question,
                            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off, h_off = await create(proxy, messages=question, extra_body=NO_THINKING)
    default, h_default = await create(proxy, messages=question)
    assert h_on["x-cache-key"] != h_off["x-cache-key"]
    assert h_default["x-cache-key"] == h_on["x-cache-key"] and h_default["x-cache"] == "HIT"
    thought = on.choices[0].message.model_extra
    assert thought["reasoning"] and thought["reasoning"] == thought["reasoning_content"]
    assert on.choices[0].message.content and "<think>" not in on.choices[0].message.content
    assert "reasoning" not in (off.choices[0].message.model_extra or {})
    assert off.choices[0].message.content
    streamed, h_stream = await stream(proxy, messages=question)
    assert h_stream["x-cache"] == "HIT"
    assert streamed["reasoning"] == thought["reasoning"]
    assert streamed["text"] == on.choices[0].message.content


async def test_legacy_functions_answer_with_function_call(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": ask(), "functions": [WEATHER["function"]],
                **NO_THINKING}) as resp:
        body = await resp.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"]["name"] == "get_weather"
    assert "tool_calls" not in choice["message"]


async def test_the_demo_model_copies_the_city_the_result_and_the_animal(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    for city in CITIES:
        miss, _ = await create(proxy, messages=ask(city), tools=[WEATHER])
        assert [json.loads(c["arguments"]) for c in calls_of(miss)] == [{"city": city}]
    messages = [*ask("Berlin"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": json.dumps({"forecast": "snowy", "temperature": 2})}]
    answer, _ = await create(proxy, messages=messages, tools=[WEATHER])
    assert "snowy" in answer.choices[0].message.content
    fox, _ = await create(proxy, messages=[{"role": "user", "content": "What does the fox eat?"}])
    assert "fox" in fox.choices[0].message.content


async def test_bad_tool_requests_are_400s_that_name_the_field(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    cases = [
        ({"tools": [bad]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ({"messages": [*ask(), {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"messages": [*ask(), {"role": "tool", "tool_call_id": "call_x", "content": "x"}]},
         "messages[1].tool_call_id"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await proxy.client.chat.completions.create(model=MODEL, **{"messages": ask(), **extra})
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == param, error
        assert error["code"] in ("invalid_request_error", "unsupported_parameter")
    assert await proxy.entries() == 0  # nothing stored
