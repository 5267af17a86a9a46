"""Responses API shapes: the `response` object, and its typed stream of events.

A generation is rendered as output items in the order it produced them (`segments`): each
run of thought (a `reasoning` item), each run of text (a `message` with one `output_text`
part), each tool call (a `function_call` item). Item ids (from the key and the item's output
index) and call ids are derived from the cache key, like chat tool-call ids, so a
HIT and a regeneration give the same bytes and the same call ids as the chat API. A stream
is the events a client expects, each with its `sequence_number`; a streamed HIT replays the
stored chunks as the same events.
"""

from __future__ import annotations

from typing import Any

import orjson
import xxhash

from cacheproxy.edge.apis.frame import Frame, call_id
from cacheproxy.edge.apis.responses.request import PATHS
from cacheproxy.edge.apis.responses.tools import seal
from cacheproxy.errors import ProxyError
from cacheproxy.keys.codec import Chunk, Output, ToolCallOut
from cacheproxy.keys.paths import renamed


def _item_id(frame: Frame, kind: str, index: int = 0) -> str:
    return f"{kind}_" + xxhash.xxh3_64_hexdigest(f"{frame.key}/{kind}/{index}".encode())


def _echo(frame: Frame) -> dict[str, Any]:
    return orjson.loads(frame.delivery.echo) if frame.delivery.echo else {}


def _reasoning_item(frame: Frame, index: int, text: str, status: str) -> dict[str, Any]:
    echo = _echo(frame)
    summary = [{"type": "summary_text", "text": text}] if echo.get("summary") else []
    item = {"id": _item_id(frame, "rs", index), "type": "reasoning", "summary": summary,
            "content": [{"type": "reasoning_text", "text": text}], "status": status}
    if echo.get("encrypted"):  # asked for: the thought in the form a client sends back
        item["encrypted_content"] = seal(text)
    return item


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(frame: Frame, index: int, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": _item_id(frame, "msg", index), "type": "message", "role": "assistant",
            "status": status, "content": content}


def _call_item(frame: Frame, index: int, call: ToolCallOut, status: str,
               arguments: str) -> dict[str, Any]:
    item = {"id": _item_id(frame, "fc", index), "type": "function_call",
            "status": status, "call_id": call_id(frame.key, 0, call.index), "name": call.name,
            "arguments": arguments}
    namespace = (_echo(frame).get("namespaces") or {}).get(call.name)
    if namespace is not None:  # a function of a namespace tool is called by both names
        item["namespace"] = namespace
    return item


def segments(output: Output) -> list[tuple[str, str | ToolCallOut]]:
    """The output items in the order the stream opens them: runs of reasoning or text (one
    item per run), each tool call; an answer with neither text nor calls has an empty
    message. An item's position is its output index, and its id is derived from it."""
    out: list[tuple[str, str | ToolCallOut]] = []
    for chunk in output.chunks:
        for kind, text in (("reasoning", chunk.reasoning), ("message", chunk.text)):
            if text and out and out[-1][0] == kind:
                out[-1] = (kind, str(out[-1][1]) + text)
            elif text:
                out.append((kind, text))
        out += [("call", call) for call in chunk.tool_calls]
    if not output.text and not output.tool_calls:
        out.append(("message", ""))
    return out


def _ending(output: Output) -> str:
    """The status of the item open at the end (cut by max_output_tokens: incomplete)."""
    return "incomplete" if output.finish_reason == "length" else "completed"


def items(frame: Frame, output: Output) -> list[dict[str, Any]]:
    """The output items of a finished generation, as its stream ends them."""
    found = segments(output)
    out = []
    for index, (kind, value) in enumerate(found):
        status = _ending(output) if index == len(found) - 1 else "completed"
        if isinstance(value, ToolCallOut):
            out.append(_call_item(frame, index, value, "completed", value.arguments))
        elif kind == "reasoning":
            out.append(_reasoning_item(frame, index, value, status))
        else:
            out.append(_message_item(frame, index, value, status))
    return out


def usage(output: Output, cached: bool, reused: int = 0) -> dict[str, Any]:
    """Token counts; reasoning tokens are those of chunks that hold only reasoning."""
    thinking = sum(len(c.tokens) for c in output.chunks
                   if c.reasoning and not c.text and not c.tool_calls)
    p, c = output.prompt_tokens, output.completion_tokens
    return {"input_tokens": p,
            "input_tokens_details": {"cached_tokens": p if cached else reused,
                                     "cache_write_tokens": 0},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": thinking},
            "total_tokens": p + c}


def response(frame: Frame, output: Output | None) -> dict[str, Any]:
    """The response object; `output` None while it is still being generated."""
    echo = _echo(frame)
    status, done_at, incomplete, output_items, counts = "in_progress", None, None, [], None
    if output is not None:
        output_items, counts = items(frame, output), usage(output, frame.cached, frame.reused)
        if output.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            status, done_at = "completed", frame.created
    reasoning = echo.get("reasoning") or {}
    return {
        "id": frame.id, "object": "response", "created_at": frame.created, "status": status,
        "completed_at": done_at, "error": None, "incomplete_details": incomplete,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"), "model": frame.model,
        "output": output_items, "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": False, "temperature": echo.get("temperature"),
        "text": {"format": echo.get("text_format") or {"type": "text"}},
        "tool_choice": echo.get("tool_choice", "auto"), "tools": echo.get("tools") or [],
        "top_p": echo.get("top_p"), "truncation": "disabled", "usage": counts,
        "metadata": echo.get("metadata") or {},
    }


def _event(kind: str, number: int, fields: dict[str, Any]) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": number, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class ResponsesStream:
    """The events of one response, rendered chunk by chunk (live, or from a stored answer)."""

    def __init__(self, frame: Frame) -> None:
        self._frame = frame
        self._number = 0
        self._outputs = 0  # output items opened so far
        self._open: tuple[str, int] | None = None  # ("reasoning" | "message", output index)
        self._text = ""  # of the open item

    def _emit(self, kind: str, **fields: Any) -> bytes:
        out = _event(kind, self._number, fields)
        self._number += 1
        return out

    def start(self) -> bytes:
        """response.created and response.in_progress."""
        pending = response(self._frame, None)
        return self._emit("response.created", response=pending) + \
            self._emit("response.in_progress", response=pending)

    def chunk(self, chunk: Chunk) -> bytes:
        """The events of one stored or live chunk."""
        out = b""
        if chunk.reasoning:
            out += self._text_delta("reasoning", chunk.reasoning)
        if chunk.text:
            out += self._text_delta("message", chunk.text)
        for call in chunk.tool_calls:
            out += self._close() + self._call(call)
        return out

    done = b""  # nothing after the last event (chat streams end with `data: [DONE]`)

    def error(self, error: ProxyError) -> bytes:
        """A failure after the stream began: an `error` event (naming Responses' path)."""
        error = renamed(error, PATHS)
        return self._emit("error", code=error.code, message=error.message, param=error.param)

    def end(self, output: Output) -> bytes:
        """Close what is open; response.completed (or .incomplete at max_output_tokens)."""
        if not output.text and not output.tool_calls:
            out = self._close() + self._open_item("message") + self._close(_ending(output))
        else:
            out = self._close(_ending(output))
        kind = "response.incomplete" if output.finish_reason == "length" else "response.completed"
        return out + self._emit(kind, response=response(self._frame, output))

    def _text_delta(self, kind: str, delta: str) -> bytes:
        out = b""
        if self._open is None or self._open[0] != kind:
            out += self._close() + self._open_item(kind)
        index = self._outputs - 1  # the item just opened, or the open one: always the last
        self._text += delta
        item = self._item_id(kind, index)
        if kind == "reasoning":
            return out + self._emit("response.reasoning_text.delta", item_id=item,
                                    output_index=index, content_index=0, delta=delta)
        return out + self._emit("response.output_text.delta", item_id=item,
                                output_index=index, content_index=0, delta=delta, logprobs=[])

    def _item_id(self, kind: str, index: int) -> str:
        return _item_id(self._frame, "rs" if kind == "reasoning" else "msg", index)

    def _open_item(self, kind: str) -> bytes:
        index, self._outputs = self._outputs, self._outputs + 1
        self._open, self._text = (kind, index), ""
        if kind == "reasoning":
            item = {**_reasoning_item(self._frame, index, "", "in_progress"), "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = _message_item(self._frame, index, None, "in_progress")
            part = _text_part("")
        return self._emit("response.output_item.added", output_index=index, item=item) + \
            self._emit("response.content_part.added", item_id=item["id"], output_index=index,
                       content_index=0, part=part)

    def _close(self, status: str = "completed") -> bytes:
        if self._open is None:
            return b""
        (kind, index), text = self._open, self._text
        self._open, self._text = None, ""
        item_id = self._item_id(kind, index)
        if kind == "reasoning":
            item = _reasoning_item(self._frame, index, text, status)
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            done = self._emit("response.reasoning_text.done", item_id=item_id,
                              output_index=index, content_index=0, text=text)
        else:
            item, part = _message_item(self._frame, index, text, status), _text_part(text)
            done = self._emit("response.output_text.done", item_id=item_id, output_index=index,
                              content_index=0, text=text, logprobs=[])
        return done + self._emit("response.content_part.done", item_id=item_id,
                                 output_index=index, content_index=0, part=part) + \
            self._emit("response.output_item.done", output_index=index, item=item)

    def _call(self, call: ToolCallOut) -> bytes:
        index, self._outputs = self._outputs, self._outputs + 1
        item_id = _item_id(self._frame, "fc", index)
        return (self._emit("response.output_item.added", output_index=index,
                           item=_call_item(self._frame, index, call, "in_progress", ""))
                + self._emit("response.function_call_arguments.delta", item_id=item_id,
                             output_index=index, delta=call.arguments)
                + self._emit("response.function_call_arguments.done", item_id=item_id,
                             output_index=index, name=call.name, arguments=call.arguments)
                + self._emit("response.output_item.done", output_index=index,
                             item=_call_item(self._frame, index, call, "completed",
                                             call.arguments)))


def error_body(error: ProxyError) -> dict[str, object]:
    """OpenAI's error object, naming the Responses path of a field chat's checks named."""
    return renamed(error, PATHS).body()
