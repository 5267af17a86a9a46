"""A Responses API request as the equivalent Chat Completions request.

One generation serves both APIs: `/v1/responses` is translated into the chat body that asks
for the same answer, and that body is canonicalized by `canonical.parse` like any other, so
the two share one cache entry. What the translation does:

- `instructions` -> a first system turn; `input` (a string) -> a user turn;
- `input` items: a `message` (text parts `input_text` / `output_text`) -> a turn of its role;
  a `function_call` -> a tool call of the assistant turn it follows (or a new one); a
  `function_call_output` -> a tool turn answering its `call_id`; a `reasoning` item -> the
  reasoning of the next assistant turn;
- `tools` (function tools, and the functions of `namespace` tools: `responses_tools`),
  `tool_choice`, `parallel_tool_calls`, `max_output_tokens`,
  `temperature`, `top_p` -> their chat forms; `reasoning.effort` -> `reasoning_effort` (which
  reaches the template as `reasoning_effort`, and as `enable_thinking`: off for "none" and
  "minimal", on for any other effort);
- every other field is passed, moot or refused (400) by name, never dropped
  (`responses_fields`): this server keeps no state (`previous_response_id`, `conversation`,
  `store: true`, `background: true` and item references are refused); `client_metadata`
  (Codex sends its session, turn and installation ids) and `prompt_cache_key` describe the
  caller, not the question: passed, never keyed; `include` is honoured
  (`responses_tools.includes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import orjson

from cacheproxy.edge.apis.responses import fields as responses_fields
from cacheproxy.edge.apis.responses import tools as responses_tools
from cacheproxy.errors import InvalidRequest, Unsupported
from cacheproxy.keys import fields
from cacheproxy.keys.canonical import Parsed, RunnerDefaults, parse
from policies.sampling import SamplingMode


@dataclass(frozen=True, slots=True)
class Echo:
    """What a response object repeats of its request (none of it is keyed)."""

    instructions: str | None
    metadata: Mapping[str, Any]
    tools: tuple[Any, ...]
    tool_choice: Any
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    text_format: Mapping[str, Any]
    reasoning: Mapping[str, Any]
    summary: bool  # reasoning.summary asked: the thought is also given as its summary
    encrypted: bool  # include reasoning.encrypted_content: the thought, sealed, as well
    namespaces: Mapping[str, str]  # function name -> the namespace tool it came from


def translate(body: Mapping[str, Any]) -> tuple[dict[str, Any], Echo]:
    """The chat body of a Responses request, and what the response echoes."""
    responses_fields.check(body)
    included = responses_tools.includes(body)
    chat: dict[str, Any] = {"messages": _messages(body)}
    for name in ("model", "stream", "temperature", "top_p", "parallel_tool_calls",
                 "chat_template_kwargs"):
        if body.get(name) is not None:
            chat[name] = body[name]
    effort, summary, summarized = responses_fields.reasoning(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    namespaces: dict[str, str] = {}
    if body.get("tools") is not None:
        chat["tools"], namespaces = responses_tools.tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = responses_fields.tool_choice(body["tool_choice"])
    text_format = responses_fields.text_format(body)
    if text_format["type"] != "text":
        chat["response_format"] = _response_format(text_format)
    return chat, Echo(
        instructions=body.get("instructions"), metadata=fields.obj(body, "metadata"),
        tools=tuple(body.get("tools") or ()), tool_choice=body.get("tool_choice", "auto"),
        parallel_tool_calls=fields.boolean(body, "parallel_tool_calls", True),
        temperature=body.get("temperature"), top_p=body.get("top_p"),
        max_output_tokens=body.get("max_output_tokens"), text_format=text_format,
        reasoning={"effort": effort, "summary": summary}, summary=summarized,
        encrypted=responses_tools.ENCRYPTED_REASONING in included, namespaces=namespaces)


def _response_format(form: Mapping[str, Any]) -> dict[str, Any]:
    if form["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {
        k: form[k] for k in ("name", "schema", "strict", "description") if k in form}}


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        return [*messages, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'input' must be a string or a non-empty list of items",
                             param="input")
    thought = ""
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought += _reasoning_text(item, where)
            continue
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(_output(item, where))
        else:
            raise Unsupported(f"'{where}.type' {kind!r} is not supported (items: message, "
                              "function_call, function_call_output, reasoning)",
                              param=f"{where}.type")
        if thought and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], thought = thought, ""
    if thought:
        raise InvalidRequest("a 'reasoning' item must come before the assistant message or "
                             "function call it led to", param="input")
    return messages


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"'{where}.role' must be user, system, developer or assistant",
                             param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or \
                    not isinstance(part.get("text"), str):
                raise Unsupported(f"'{where}.content[{j}]' must be a text part",
                                  param=f"{where}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidRequest(f"'{where}.content' must be a string or a list of text parts",
                             param=f"{where}.content")
    return {"role": role, "content": content}


def _add_call(messages: list[dict[str, Any]], item: Mapping[str, Any], where: str) -> None:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
        raise InvalidRequest(f"'{where}' needs a string 'call_id' and 'name'", param=where)
    arguments = item.get("arguments", "{}")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)  # the calls of the turn they follow
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"'{where}.call_id' must be a non-empty string",
                             param=f"{where}.call_id")
    if isinstance(output, list):
        output = _message({"role": "user", "content": output}, where)["content"]
    if not isinstance(output, str):
        raise InvalidRequest(f"'{where}.output' must be a string", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """The thought of a reasoning item: sealed (as this server wrote it), or as text."""
    if item.get("encrypted_content") is not None:
        return responses_tools.unseal(item["encrypted_content"], f"{where}.encrypted_content")
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise InvalidRequest(f"'{where}.content' must be a list", param=f"{where}.content")
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))








def parse_responses(body: object, defaults: RunnerDefaults, mode: SamplingMode, *,
                    max_tokens_cap: int | None = None,
                    max_answer_tokens: int | None = None) -> Parsed:
    """The canonical request of a Responses body: its chat translation's, so that both APIs
    key the same answer alike; the delivery says which API renders it."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    chat, echo = translate(body)
    parsed = parse(chat, "chat", defaults, mode, max_tokens_cap=max_tokens_cap,
                   max_answer_tokens=max_answer_tokens)
    return replace(parsed, delivery=replace(parsed.delivery, api="responses",
                                            echo=orjson.dumps(asdict(echo))))
