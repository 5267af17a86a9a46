"""A Responses API request as the equivalent Chat Completions request.

One generation serves both APIs: `/v1/responses` is translated into the chat body that asks
for the same answer, and that body is canonicalized by `canonical.parse` like any other, so
the two share one cache entry. What the translation does:

- `instructions` -> a first system turn; `input` (a string) -> a user turn;
- `input` items: a `message` (text parts `input_text` / `output_text`) -> a turn of its role;
  a `function_call` -> a tool call of the assistant turn it follows (or a new one); a
  `function_call_output` -> a tool turn answering its `call_id`; a `reasoning` item -> the
  reasoning of the next assistant turn; every other key of an item or part is passed (`id`,
  `status`... as clients echo output items back) or refused by its path (`responses_items`);
- `tools` (function tools, and the functions of `namespace` tools: `responses_tools`),
  `tool_choice`, `parallel_tool_calls`, `max_output_tokens`,
  `temperature`, `top_p` -> their chat forms; `reasoning.effort` -> `reasoning_effort` (which
  reaches the template as `reasoning_effort`, and as `enable_thinking`: off for "none" and
  "minimal", on for any other effort; "max" is "xhigh", the most a template can be asked);
- every other field is passed, moot or refused (400) by name, never dropped
  (`responses_fields`): this server keeps no state (`previous_response_id`, `conversation`,
  `store: true`, `background: true` and item references are refused); `client_metadata`
  (Codex sends its session, turn and installation ids) and `prompt_cache_key` describe the
  caller, not the question: passed, never keyed; `include` is honoured
  (`responses_tools.includes`);
- an error a check of the chat request raises names the field as this request does
  (`max_output_tokens`, `text.format.schema`, `tools[i].parameters`, `input[i].arguments`:
  `PATHS` and the origins `translation` records; `keys.paths`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import orjson

from cacheproxy.edge.apis.responses import fields as responses_fields
from cacheproxy.edge.apis.responses import items as responses_items
from cacheproxy.edge.apis.responses import tools as responses_tools
from cacheproxy.errors import InvalidRequest, ProxyError, Unsupported
from cacheproxy.keys import fields
from cacheproxy.keys.canonical import Parsed, RunnerDefaults, parse
from cacheproxy.keys.paths import Origin, Paths, renamed
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


# Where the chat request's fields came from, for an error a chat check raises (its tools,
# turns and calls: `translation`); alone, for one raised while generating.
PATHS = Paths(prefixes=(("max_tokens", "max_output_tokens"),
                        ("response_format.json_schema", "text.format"),
                        ("response_format", "text.format"),
                        ("reasoning_effort", "reasoning.effort"), ("messages", "input")))
_TOOL = ((".function", ""),)  # tools[i].function.parameters -> tools[k].parameters
_CALL = ((".function", ""), (".id", ".call_id"))
_OUTPUT = ((".tool_call_id", ".call_id"), (".content", ".output"))


def translate(body: Mapping[str, Any]) -> tuple[dict[str, Any], Echo]:
    """The chat body of a Responses request, and what the response echoes."""
    chat, echo, _ = translation(body)
    return chat, echo


def translation(body: Mapping[str, Any]) -> tuple[dict[str, Any], Echo, Paths]:
    """The chat body of a Responses request, what the response echoes, and where each chat
    field came from in the request."""
    responses_fields.check(body)
    included = responses_tools.includes(body)
    turns: list[Origin] = []
    calls: dict[tuple[int, int], Origin] = {}
    chat: dict[str, Any] = {"messages": _messages(body, turns, calls)}
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
    paths = replace(PATHS, tools=_tool_origins(body), messages=turns, calls=calls)
    return chat, Echo(
        instructions=body.get("instructions"), metadata=fields.obj(body, "metadata"),
        tools=tuple(body.get("tools") or ()), tool_choice=body.get("tool_choice", "auto"),
        parallel_tool_calls=fields.boolean(body, "parallel_tool_calls", True),
        temperature=body.get("temperature"), top_p=body.get("top_p"),
        max_output_tokens=body.get("max_output_tokens"), text_format=text_format,
        reasoning={"effort": effort, "summary": summary}, summary=summarized,
        encrypted=responses_tools.ENCRYPTED_REASONING in included, namespaces=namespaces), paths


def _tool_origins(body: Mapping[str, Any]) -> list[Origin]:
    """The path of each chat tool's function (a function tool, or one of a namespace's)."""
    out = []
    for i, tool in enumerate(body.get("tools") or ()):
        if tool.get("type") == "namespace":
            out += [Origin(f"tools[{i}].tools[{j}]", _TOOL) for j in range(len(tool["tools"]))]
        else:
            out.append(Origin(f"tools[{i}]", _TOOL))
    return out


def _response_format(form: Mapping[str, Any]) -> dict[str, Any]:
    if form["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {
        k: form[k] for k in ("name", "schema", "strict", "description") if k in form}}


def _messages(body: Mapping[str, Any], turns: list[Origin],
              calls: dict[tuple[int, int], Origin]) -> list[dict[str, Any]]:
    """The chat turns of `instructions` and `input`; where each turn (`turns`) and each
    call of an assistant turn (`calls`) came from."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
        turns.append(Origin("instructions", ((".content", ""),)))
    raw = body.get("input")
    if isinstance(raw, str):
        turns.append(Origin("input", ((".content", ""),)))
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
        if isinstance(kind, str) and kind in responses_items.ITEM_KEYS:
            responses_items.check(item, kind, where)
        if kind == "reasoning":
            thought += _reasoning_text(item, where)
            continue
        if kind == "message":
            messages.append(_message(item, where))
            turns.append(Origin(where))
        elif kind == "function_call":
            _add_call(messages, item, where)
            if len(turns) < len(messages):
                turns.append(Origin(where))
            calls[len(messages) - 1, len(messages[-1]["tool_calls"]) - 1] = Origin(where, _CALL)
        elif kind == "function_call_output":
            messages.append(_output(item, where))
            turns.append(Origin(where, _OUTPUT))
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
        content = responses_items.texts(content, f"{where}.content")
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
        output = responses_items.texts(output, f"{where}.output")
    if not isinstance(output, str):
        raise InvalidRequest(f"'{where}.output' must be a string", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """The thought of a reasoning item: sealed (as this server wrote it), or as text."""
    given = responses_items.thought(item, where)
    if item.get("encrypted_content") is not None:
        return responses_tools.unseal(item["encrypted_content"], f"{where}.encrypted_content")
    return given


def parse_responses(body: object, defaults: RunnerDefaults, mode: SamplingMode, *,
                    max_tokens_cap: int | None = None,
                    max_answer_tokens: int | None = None) -> Parsed:
    """The canonical request of a Responses body: its chat translation's, so that both APIs
    key the same answer alike; the delivery says which API renders it."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    chat, echo, paths = translation(body)
    try:
        parsed = parse(chat, "chat", defaults, mode, max_tokens_cap=max_tokens_cap,
                       max_answer_tokens=max_answer_tokens)
    except ProxyError as error:  # a chat check: named as this request names the field
        raise renamed(error, paths) from None
    return replace(parsed, delivery=replace(parsed.delivery, api="responses",
                                            echo=orjson.dumps(asdict(echo))))
