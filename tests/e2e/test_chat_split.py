"""The model's text split into answer, reasoning and tool calls (runners/chat.py), with the
demo model's own tokenizer and tool parser (mlx-lm's `json_tools`): a call is a call only
when its arguments are a JSON object, as a tool's input is."""

from __future__ import annotations

import pytest

from cacheproxy.keys.canonical import parse
from cacheproxy.runners.chat import ChatPrompt, ChatSplit, Pieces
from cacheproxy.runners.mlx import MlxRunner
from policies.sampling import SamplingMode

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


def _split(runner: MlxRunner, written: str) -> Pieces:
    """What the model's `written` text becomes, as generated at the end of a chat answer."""
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    request = parse(body, "chat", runner.defaults(), SamplingMode.FORCE_GREEDY).request
    split = ChatSplit(runner.tokenizer, request, ChatPrompt([]))
    fed, ended = split.feed(written), split.end(eos=True)
    return Pieces(fed.content + ended.content, fed.reasoning + ended.reasoning,
                  fed.calls + ended.calls)


@pytest.mark.parametrize("arguments", ["[1, 2]", '"Paris"', "7", "null", '"[1]"',
                                       '"not json"'])
async def test_a_call_whose_arguments_are_no_object_is_the_text_the_model_wrote(
        runner: MlxRunner, arguments: str) -> None:
    written = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    pieces = _split(runner, written)
    assert pieces.calls == () and pieces.content == written


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"city": "Paris"}', '{"city": "Paris"}'),
    ('"{\\"city\\": \\"Paris\\"}"', '{"city": "Paris"}'),  # JSON text of an object, as written
    ("{}", "{}")])
async def test_control_a_call_with_an_object_is_a_call(runner: MlxRunner, arguments: str,
                                                       expected: str) -> None:
    written = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    (call,) = _split(runner, written).calls
    assert (call.name, call.arguments) == ("get_weather", expected)
