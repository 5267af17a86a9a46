"""The Messages renderer: the message a stream builds (as the `anthropic` SDK accumulates its
events) is the whole message, block for block, for thought, text and calls in any order."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from cacheproxy.edge.apis import replay
from cacheproxy.edge.apis.frame import Frame
from cacheproxy.edge.apis.messages.render import MessagesStream, body
from cacheproxy.edge.apis.responses.tools import opened
from cacheproxy.keys.canonical import Delivery
from cacheproxy.keys.codec import Chunk, Output, ToolCallOut

EVENT = TypeAdapter(RawMessageStreamEvent)
CALL = ToolCallOut(0, "get_weather", '{"city": "Lima"}')
CHUNKS = (Chunk("", (1,), reasoning="I look"), Chunk("", (2,), reasoning=" it up."),
          Chunk("Let me", (3,)), Chunk(" see.", (4,)), Chunk("", (5,), tool_calls=(CALL,)),
          Chunk("", (6,), reasoning="Done."), Chunk("It is", (7,)))


def frame(echo: bytes = b"", *, cached: bool = False) -> Frame:
    delivery = Delivery(True, False, 1, "demo", api="messages", echo=echo)
    return Frame("msg_1", 0, "demo", "fp", delivery, False, cached, key="ns/abc",
                 reused=2)


def streamed(frame: Frame, output: Output) -> dict[str, Any]:
    """The message the SDK's stream reader builds from the events."""
    snapshot, bufs = None, {}  # type: ignore[var-annotated]
    for block in replay(MessagesStream(frame), output).decode().split("\n\n"):
        if not block.strip() or block.startswith("event: ping"):
            continue
        event = EVENT.validate_json(block.split("\ndata: ", 1)[1])
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    return snapshot.model_dump(exclude_none=True)


@pytest.mark.parametrize(("finish", "stop", "reason"), [
    ("tool_calls", "", "tool_use"), ("length", "", "max_tokens"),
    ("stop", "", "end_turn"), ("stop", "\n\n", "stop_sequence")])
def test_the_stream_builds_the_whole_message(finish: str, stop: str, reason: str) -> None:
    output = Output(CHUNKS, finish, 10, 7, stop)
    whole = body(frame(), output)
    assert streamed(frame(), output) == Message.model_validate(whole).model_dump(
        exclude_none=True)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use",
                                                     "thinking", "text"]
    assert whole["content"][1]["text"] == "Let me see."
    assert whole["content"][2]["input"] == {"city": "Lima"}
    assert whole["content"][0]["signature"] != whole["content"][3]["signature"]
    assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, stop or None)
    assert whole["usage"]["input_tokens"] == 8 and whole["usage"]["cache_read_input_tokens"] == 2
    assert body(frame(cached=True), output)["usage"]["cache_read_input_tokens"] == 10


def test_omitted_thinking_keeps_its_blocks_with_the_thought_sealed_as_the_signature() -> None:
    output = Output(CHUNKS, "stop", 10, 7)
    omitted = frame(b'{"omit_thinking": true}')
    whole = body(omitted, output)
    thoughts = [b for b in whole["content"] if b["type"] == "thinking"]
    assert [b["thinking"] for b in thoughts] == ["", ""]
    assert [opened(b["signature"]) for b in thoughts] == ["I look it up.", "Done."]
    assert streamed(omitted, output)["content"] == whole["content"]
    assert b"thinking_delta" not in replay(MessagesStream(omitted), output)
    # Control: a shown thought's signature is a token that seals nothing.
    shown = [b for b in body(frame(), output)["content"] if b["type"] == "thinking"]
    assert [b["thinking"] for b in shown] == ["I look it up.", "Done."]
    assert [opened(b["signature"]) for b in shown] == [None, None]


def test_a_failure_after_the_stream_began_is_an_error_event_in_anthropics_shape() -> None:
    from cacheproxy.edge.apis.messages.render import MessagesStream
    from cacheproxy.errors import GenerationTimeout

    event = MessagesStream(frame()).error(GenerationTimeout("the generation took over 300 s"))
    assert event == (b'event: error\ndata: {"type":"error","error":{"type":"timeout_error",'
                     b'"message":"the generation took over 300 s"}}\n\n')


@pytest.mark.parametrize("arguments", ["[1, 2]", '"Lima"', "7", "null", "not json"])
def test_a_call_whose_arguments_are_no_object_is_text_never_a_tool_use(arguments: str) -> None:
    # (An entry stored before the runner refused such calls.) tool_use.input must be an
    # object: the call is the text the model wrote, in the text block it follows.
    odd = ToolCallOut(0, "get_weather", arguments)
    output = Output((Chunk("It is", (1,)), Chunk("", (2,), tool_calls=(odd,))), "tool_calls",
                    10, 2)
    whole = body(frame(), output)
    assert Message.model_validate(whole)  # what the SDK reads
    (block,) = whole["content"]
    assert block["type"] == "text" and block["text"].startswith('It is{"name":"get_weather"')
    assert (whole["stop_reason"], streamed(frame(), output)["content"]) == ("end_turn",
                                                                           whole["content"])
    # Control: with an object the same call is a tool_use block, and the reason tool_use.
    fine = Output((Chunk("It is", (1,)), Chunk("", (2,), tool_calls=(CALL,))), "tool_calls",
                  10, 2)
    assert [b["type"] for b in body(frame(), fine)["content"]] == ["text", "tool_use"]
    assert body(frame(), fine)["stop_reason"] == "tool_use"
