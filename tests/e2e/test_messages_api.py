"""The Anthropic Messages API over the same cache, driven by the `anthropic` SDK and
LangChain's ChatAnthropic as their users drive them: whole and streamed answers (every event
checked against the SDK's own types), tools and a tool_result turn, structured output,
count_tokens, errors as the SDK's exceptions, and one entry shared with chat completions and
Responses."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import BaseModel, TypeAdapter

from cacheproxy.edge.state import PROXY
from tests.conftest import Proxy, ProxyFactory

MODEL = "cacheproxy-demo"
EVENT = TypeAdapter(RawMessageStreamEvent)


class Ping(BaseModel):
    """The keep-alive event."""

    type: str = "ping"


PING = Ping()
WEATHER = {"name": "get_weather", "description": "Get the weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
FOX = [{"role": "user", "content": "What does the fox eat?"}]


def client(proxy: Proxy, **kw: Any) -> anthropic.AsyncAnthropic:
    """The SDK pointed at the proxy, as a user points it (base_url without /v1)."""
    return anthropic.AsyncAnthropic(base_url=proxy.url, max_retries=0,
                                    **{"api_key": "unused", **kw})


async def create(proxy: Proxy, **kw: Any) -> tuple[Any, dict[str, str]]:
    """A message through the SDK, with the response headers."""
    async with client(proxy) as sdk:
        raw = await sdk.messages.with_raw_response.create(model=MODEL, **kw)
        return await raw.parse(), dict(raw.headers)


async def events(proxy: Proxy, body: dict[str, Any]) -> tuple[list[Any], bytes, dict[str, str]]:
    """A streamed message read off the wire: each event parsed with the SDK's types."""
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/messages?beta=true",
            json={"model": MODEL, "max_tokens": 64, **body, "stream": True}) as resp:
        raw = await resp.read()
        headers = dict(resp.headers)
    found = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            kind, data = block.split("\n", 1)
            fields = json.loads(data.removeprefix("data: "))
            # (A ping has no type of its own in the SDK: its stream reader skips it.)
            event = PING if fields == {"type": "ping"} else EVENT.validate_python(fields)
            assert kind == f"event: {event.type}"
            found.append(event)
    return found, raw, headers


async def test_create_is_a_miss_then_a_hit_and_one_entry_with_chat_and_responses(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    thinking = {"type": "adaptive"}  # (absent is off, as in Anthropic's API)
    first, h1 = await create(proxy, max_tokens=64, messages=FOX, thinking=thinking)
    second, h2 = await create(proxy, max_tokens=64, messages=FOX, thinking=thinking)
    assert (h1["x-cache"], h2["x-cache"]) == ("MISS", "HIT")
    assert first.content == second.content and first.id != second.id
    assert [b.type for b in first.content] == ["thinking", "text"]
    assert first.stop_reason == "end_turn" and first.id.startswith("msg_")
    assert second.usage.cache_read_input_tokens == first.usage.input_tokens + \
        first.usage.cache_read_input_tokens and second.usage.input_tokens == 0
    assert second.usage.output_tokens == first.usage.output_tokens
    text = first.content[1].text
    chat = await proxy.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=FOX, max_tokens=64)
    assert chat.headers["x-cache"] == "HIT" and chat.headers["x-cache-key"] == h1["x-cache-key"]
    message = chat.parse().choices[0].message
    assert message.content == text
    assert message.model_extra["reasoning"] == first.content[0].thinking
    responses = await proxy.client.responses.with_raw_response.create(
        model=MODEL, input="What does the fox eat?", max_output_tokens=64)
    assert responses.headers["x-cache"] == "HIT" and responses.parse().output_text == text
    assert await proxy.entries() == 1
    # Control: the same question without the thought is another answer, another entry, and
    # `thinking` absent is that one (opt-in, as in Anthropic's API; chat's default thinks).
    off, h4 = await create(proxy, max_tokens=64, messages=FOX, thinking={"type": "disabled"})
    assert h4["x-cache"] == "MISS" and h4["x-cache-key"] != h1["x-cache-key"]
    _, h5 = await create(proxy, max_tokens=64, messages=FOX)
    assert h5["x-cache"] == "HIT" and h5["x-cache-key"] == h4["x-cache-key"]
    assert [b.type for b in off.content] == ["text"]


async def test_a_streamed_hit_has_the_events_and_boundaries_of_the_miss(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    body = {"messages": [{"role": "user", "content": "Tell me about the cat."}],
            "thinking": {"type": "adaptive"}}
    miss, miss_raw, h1 = await events(proxy, body)
    hit, hit_raw, h2 = await events(proxy, body)
    assert (h1["X-Cache"], h2["X-Cache"]) == ("MISS", "HIT")
    kinds = [e.type for e in miss]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                     "message_stop"]
    deltas = {e.delta.type for e in miss if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "signature_delta", "text_delta"}
    # Several text deltas: the comparison below checks the boundaries, not one lump of text.
    assert sum(e.type == "content_block_delta" and e.delta.type == "text_delta"
               for e in miss) > 3
    # Event for event, the same bytes but the message id (and the usage a HIT reads).
    miss_id, hit_id = miss[0].message.id, hit[0].message.id
    same = [e.model_dump() for e in miss[1:-2]]
    assert same == [e.model_dump() for e in hit[1:-2]]
    assert miss_raw.count(b"\n\n") == hit_raw.count(b"\n\n") and miss_id != hit_id
    assert hit[-2].usage.cache_read_input_tokens == miss[-2].usage.input_tokens
    # The SDK's own stream reader takes the same events, and its message is the whole one.
    async with client(proxy) as sdk, sdk.messages.stream(model=MODEL, max_tokens=64,
                                                         **body) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    whole, h3 = await create(proxy, max_tokens=64, **body)
    assert h3["x-cache"] == "HIT"
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == \
        [b.model_dump() for b in whole.content]
    assert text == whole.content[1].text == "".join(
        e.delta.text for e in miss if e.type == "content_block_delta"
        and e.delta.type == "text_delta")


async def test_an_omitted_thought_goes_back_in_the_history_as_if_shown(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    omitted = {"type": "adaptive", "display": "omitted"}
    hidden, h1 = await create(proxy, max_tokens=64, messages=FOX, thinking=omitted)
    shown, h2 = await create(proxy, max_tokens=64, messages=FOX, thinking={"type": "adaptive"})
    assert (h1["x-cache"], h2["x-cache"]) == ("MISS", "HIT")  # one answer, shown two ways
    assert hidden.content[0].thinking == "" and shown.content[0].thinking
    follow = {"role": "user", "content": "And the owl?"}

    def history(reply: Any) -> list[dict[str, Any]]:  # as SDK users append a reply
        return [*FOX, {"role": "assistant", "content": reply.content}, follow]

    _, h3 = await create(proxy, max_tokens=64, messages=history(hidden), thinking=omitted)
    _, h4 = await create(proxy, max_tokens=64, messages=history(shown), thinking=omitted)
    assert (h3["x-cache"], h4["x-cache"]) == ("MISS", "HIT")
    # Control: without the thought the history is another prompt, another entry.
    bare = [*FOX, {"role": "assistant", "content": shown.content[1:]}, follow]
    _, h5 = await create(proxy, max_tokens=64, messages=bare, thinking=omitted)
    assert h5["x-cache"] == "MISS" and h5["x-cache-key"] != h3["x-cache-key"]
    forged = [*FOX, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "", "signature": "EqQBCkgIAhABGAIiQ"},
        *shown.content[1:]]}, follow]
    with pytest.raises(anthropic.BadRequestError) as refused:
        await create(proxy, max_tokens=64, messages=forged, thinking=omitted)
    assert "'messages[1].content[0].signature'" in refused.value.message


async def test_tools_a_tool_result_turn_and_tool_choice(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call, h1 = await create(proxy, max_tokens=64, messages=ask, tools=[WEATHER])
    again, h2 = await create(proxy, max_tokens=64, messages=ask, tools=[WEATHER])
    (use,) = [b for b in call.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert call.stop_reason == "tool_use" and use.id.startswith("toolu_")
    assert (h1["x-cache"], h2["x-cache"]) == ("MISS", "HIT") and again.content == call.content
    turns = [*ask, {"role": "assistant", "content": call.content},  # as SDK users append it
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "foggy, 8 degrees"}]}]
    answer, h3 = await create(proxy, max_tokens=96, messages=turns, tools=[WEATHER])
    assert h3["x-cache"] == "MISS" and answer.stop_reason == "end_turn"
    assert "foggy" in answer.content[-1].text
    again, h4 = await create(proxy, max_tokens=96, messages=turns, tools=[WEATHER])
    assert h4["x-cache"] == "HIT" and again.content == answer.content
    forced, _ = await create(proxy, max_tokens=64, messages=[
        {"role": "user", "content": "Hello there."}], tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert [b.type for b in forced.content] == ["tool_use"] and forced.stop_reason == "tool_use"


class Animal(BaseModel):
    """What the demo model was trained to fill in (see tests/e2e/test_structured.py)."""

    animal: str
    food: str


async def test_output_config_format_is_held_to_the_schema(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    schema = {**Animal.model_json_schema(), "additionalProperties": False}
    kw = {"max_tokens": 96, "messages": FOX, "thinking": {"type": "disabled"},
          "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    first, h1 = await create(proxy, **kw)
    second, h2 = await create(proxy, **kw)
    assert (h1["x-cache"], h2["x-cache"]) == ("MISS", "HIT") and first.content == second.content
    (block,) = first.content
    assert isinstance(Animal.model_validate_json(block.text), Animal)


async def test_stop_sequences_and_max_tokens_are_the_stop_reasons(make_proxy: ProxyFactory
                                                                   ) -> None:
    proxy = await make_proxy()
    kw = {"messages": FOX, "thinking": {"type": "disabled"}}
    whole, _ = await create(proxy, max_tokens=64, **kw)
    word = whole.content[0].text.split()[2]
    cut, _ = await create(proxy, max_tokens=64, stop_sequences=[word], **kw)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
    assert whole.content[0].text.startswith(cut.content[0].text) and word not in \
        cut.content[0].text
    hit, headers = await create(proxy, max_tokens=64, stop_sequences=[word], **kw)
    assert headers["x-cache"] == "HIT" and hit.stop_sequence == word  # stored with the entry
    short, _ = await create(proxy, max_tokens=3, **kw)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    # More than chat's 4 (Anthropic has no such bound), and a 400 naming them past this
    # server's bound.
    many = [word, *(f"NEVER{i}" for i in range(8))]
    cut_many, _ = await create(proxy, max_tokens=64, stop_sequences=many, **kw)
    assert (cut_many.stop_sequence, cut_many.content) == (word, cut.content)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await create(proxy, max_tokens=64, stop_sequences=[f"S{i}" for i in range(65)], **kw)
    assert "'stop_sequences' takes at most 64" in refused.value.message


async def test_count_tokens_is_the_prompt_a_generation_reads(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    kw: dict[str, Any] = {"messages": FOX, "system": "Answer briefly.", "tools": [WEATHER]}
    async with client(proxy) as sdk:
        counted = await sdk.messages.count_tokens(model=MODEL, **kw)
    answer, headers = await create(proxy, max_tokens=32, **kw)
    assert headers["x-cache"] == "MISS"
    assert counted.input_tokens == answer.usage.input_tokens + \
        answer.usage.cache_read_input_tokens > 20
    async with client(proxy) as sdk:
        plain = await sdk.messages.count_tokens(model=MODEL, messages=FOX)
    assert plain.input_tokens < counted.input_tokens  # the system turn and the tools count


async def test_errors_are_the_sdks_exceptions_in_anthropics_shape(make_proxy: ProxyFactory
                                                                   ) -> None:
    proxy = await make_proxy(api_keys=("secret",))
    async with client(proxy, api_key="secret") as sdk:
        with pytest.raises(anthropic.NotFoundError) as missing:
            await sdk.messages.create(model="no-such-model", max_tokens=8, messages=FOX)
        with pytest.raises(anthropic.BadRequestError) as unknown:
            await sdk.messages.create(model=MODEL, max_tokens=8, messages=FOX,
                                      extra_body={"top_a": 0.5})
        with pytest.raises(anthropic.BadRequestError) as hosted:
            await sdk.messages.create(model=MODEL, max_tokens=8, messages=FOX, tools=[
                {"type": "web_search_20250305", "name": "web_search"}])
        with pytest.raises(anthropic.BadRequestError) as schema:  # a chat check, named as here
            await sdk.messages.create(model=MODEL, max_tokens=8, messages=FOX, output_config={
                "format": {"type": "json_schema", "schema": {"type": "object", "properties": 3}}})
        fine = await sdk.messages.create(model=MODEL, max_tokens=8, messages=FOX)
    assert "'output_config.format.schema'" in schema.value.message
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model 'no-such-model' does not exist"}}
    assert unknown.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "'top_a'" in unknown.value.message and "'tools[0].type'" in hosted.value.message
    assert fine.content  # x-api-key, as the SDK sends it
    async with client(proxy, api_key="wrong") as sdk:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await sdk.messages.create(model=MODEL, max_tokens=8, messages=FOX)
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    async with client(proxy, api_key=None, auth_token="secret") as sdk:  # Bearer, as Claude Code
        assert (await sdk.messages.count_tokens(model=MODEL, messages=FOX)).input_tokens


async def test_a_prompt_over_the_context_is_prompt_is_too_long(make_proxy: ProxyFactory
                                                                ) -> None:
    proxy = await make_proxy()
    long = [{"role": "user", "content": "The cat eats fish. " * 200}]  # the context: 512
    async with client(proxy) as sdk:
        counted = (await sdk.messages.count_tokens(model=MODEL, messages=long)).input_tokens
        with pytest.raises(anthropic.BadRequestError) as whole:
            await sdk.messages.create(model=MODEL, max_tokens=8, messages=long)
        with pytest.raises(anthropic.BadRequestError) as streamed:
            async with sdk.messages.stream(model=MODEL, max_tokens=8, messages=long) as events:
                await events.get_final_message()
    context = proxy.app[PROXY].runner.defaults().context_length
    assert whole.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {counted} tokens > {context - 1} maximum"}}
    assert streamed.value.body == whole.value.body and counted > context
    # Control: chat completions says it in OpenAI's words, with the same numbers.
    with pytest.raises(openai.BadRequestError) as chat:
        await proxy.client.chat.completions.create(  # (the same prompt: no thinking)
            model=MODEL, messages=long, max_tokens=8,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.value.code == "context_length_exceeded"
    assert f"is {counted} tokens" in chat.value.message


async def _refused_before_the_body(port: int, path: str, headers: bytes) -> tuple[int, Any]:
    """A POST that announces a body and waits (Expect: 100-continue, as curl sends a large
    one): the status and JSON of the answer given before a byte of the body is sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"%b\r\n\r\n" % (path.encode(), headers))
        status = int((await asyncio.wait_for(reader.readline(), 5)).split()[1])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return status, json.loads(await asyncio.wait_for(reader.readexactly(length), 5))
    finally:
        writer.close()


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_errors_before_the_body_are_in_anthropics_shape(make_proxy: ProxyFactory,
                                                              path: str) -> None:
    proxy = await make_proxy(api_keys=("secret",), max_body_bytes=4096)
    port = int(proxy.url.rsplit(":", 1)[1])
    cases = [(b"Expect: 100-continue\r\nContent-Length: 100", 401, "authentication_error"),
             (b"x-api-key: wrong\r\nExpect: 100-continue\r\nContent-Length: 100", 401,
              "authentication_error"),
             (b"x-api-key: secret\r\nExpect: 100-continue\r\nContent-Length: 5000000", 413,
              "request_too_large"),
             (b"x-api-key: secret\r\nExpect: 200-ok\r\nContent-Length: 2", 417,
              "invalid_request_error")]
    for headers, status, kind in cases:
        got, body = await _refused_before_the_body(port, path, headers)
        assert (got, body["type"], body["error"]["type"]) == (status, "error", kind), body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    # Control: chat completions' refusal of the same is in OpenAI's shape.
    got, body = await _refused_before_the_body(port, "/v1/chat/completions", cases[0][0])
    assert got == 401 and body["error"]["code"] is not None and "type" not in body
    # The SDK's view (it sends no Expect): a wrong key, a body over the limit.
    async def send(key: str, messages: list[dict[str, Any]]) -> None:
        async with client(proxy, api_key=key) as sdk:
            if path.endswith("count_tokens"):
                await sdk.messages.count_tokens(model=MODEL, messages=messages)
            else:
                await sdk.messages.create(model=MODEL, max_tokens=8, messages=messages)

    with pytest.raises(anthropic.AuthenticationError) as refused:
        await send("wrong", FOX)
    with pytest.raises(anthropic.APIStatusError) as large:
        await send("secret", [{"role": "user", "content": "x" * 5000}])
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert large.value.status_code == 413
    assert large.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]


async def test_langchain_chat_anthropic_invoke_stream_and_bind_tools(make_proxy: ProxyFactory
                                                                     ) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        return "sunny, 21 degrees"

    proxy = await make_proxy()
    chat = ChatAnthropic(model=MODEL, base_url=proxy.url, api_key="unused", max_tokens=64,
                         max_retries=0)
    first = await chat.ainvoke("What does the fox eat?")
    generated = proxy.generations
    again = await chat.ainvoke("What does the fox eat?")
    streamed = [c async for c in chat.astream("What does the fox eat?")]
    assert first.text and again.content == first.content
    assert "".join(c.text for c in streamed) == first.text
    assert proxy.generations == generated  # the repeat and the stream were HITs
    tools = chat.bind_tools([get_weather])
    call = await tools.ainvoke("What is the weather in Lima?")
    generated = proxy.generations
    repeat = await tools.ainvoke("What is the weather in Lima?")
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather",
                                                                   {"city": "Lima"})]
    assert repeat.tool_calls == call.tool_calls and proxy.generations == generated
