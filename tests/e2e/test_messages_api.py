"""The Anthropic Messages API over the same cache, driven by the `anthropic` SDK and
LangChain's ChatAnthropic as their users drive them: whole and streamed answers (every event
checked against the SDK's own types), tools and a tool_result turn, structured output,
count_tokens, errors as the SDK's exceptions, and one entry shared with chat completions and
Responses."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.conftest import Proxy, ProxyFactory

MODEL = "cacheproxy-demo"
EVENT = TypeAdapter(RawMessageStreamEvent)
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
            event = EVENT.validate_python(json.loads(data.removeprefix("data: ")))
            assert kind == f"event: {event.type}"
            found.append(event)
    return found, raw, headers


async def test_create_is_a_miss_then_a_hit_and_one_entry_with_chat_and_responses(
    make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy()
    first, h1 = await create(proxy, max_tokens=64, messages=FOX)
    second, h2 = await create(proxy, max_tokens=64, messages=FOX)
    assert (h1["x-cache"], h2["x-cache"]) == ("MISS", "HIT")
    assert first.content == second.content and first.id != second.id
    assert [b.type for b in first.content] == ["thinking", "text"]  # it thinks by default
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
