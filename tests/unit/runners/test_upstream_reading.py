"""An upstream stream relayed (runners/upstream_wire.Reading): mlx_lm.server's tool calls are
calls only where the in-process runner's would be (tools offered, arguments a JSON object);
any other is written back as the text of the call."""

from __future__ import annotations

import pytest

from cacheproxy.keys.canonical import RunnerDefaults, parse
from cacheproxy.keys.codec import Chunk, ToolCallOut
from cacheproxy.runners.base import Generation
from cacheproxy.runners.upstream_wire import Delta, Reading
from policies.sampling import SamplingMode

DEFAULTS = RunnerDefaults(model_id="demo", aliases=frozenset(), max_tokens=256,
                          max_tokens_cap=4096, context_length=512, tool_calling=True,
                          tool_format="json_tools", grammar_engine="llguidance 1.9.1",
                          template_kwargs={})
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
MARKERS = ("<tool_call>", "</tool_call>")


def _read(arguments: str) -> Reading:
    """An upstream answer that is one call with `arguments`."""
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    request = parse(body, "chat", DEFAULTS, SamplingMode.FORCE_GREEDY).request
    reading = Reading(Generation(), request, MARKERS)
    reading.take(Delta("", None, None, "", calls=(("get_weather", arguments),)))
    reading.take(Delta("", "tool_calls", (5, 3), ""))
    return reading


@pytest.mark.parametrize("arguments", ["[1, 2]", '"Paris"', "7", "null", "not json"])
async def test_a_call_whose_arguments_are_no_object_is_text(arguments: str) -> None:
    reading = _read(arguments)
    assert (reading.calls, reading.finish) == (0, "stop")
    (chunk,) = reading.chunks
    assert chunk.tool_calls == () and chunk.text.startswith('<tool_call>\n{"name": "get_weather"')


async def test_control_a_call_with_an_object_is_a_call() -> None:
    reading = _read('{"city": "Paris"}')
    assert (reading.calls, reading.finish) == (1, "tool_calls")
    assert reading.chunks == [Chunk("", (), tool_calls=(
        ToolCallOut(0, "get_weather", '{"city": "Paris"}'),))]
