"""A Messages API request as the equivalent Chat Completions request, then canonical.

The conversation becomes chat turns (`turns`); `tools` (`input_schema`), `tool_choice`
(`auto`, `any` = required, `tool` = that function, `none`), `disable_parallel_tool_use`
(parallel_tool_calls false), `stop_sequences` (up to 64: chat's `stop` takes 4), `max_tokens`
(required; above the server's cap it is the cap: the answer then ends with `max_tokens` where
the server stops it),
`temperature`, `top_p`, `top_k`, `output_config.format` (a json_schema response_format) and
`output_config.effort` (reasoning_effort; `max` is `xhigh`) map onto their chat forms (tools
and tool_choice in `tools`: a tool with `defer_loading` is checked and not shown to the model,
this server having no tool search to load it); `context_management` is applied to the turns
(`context`);
`thinking` is the template's thinking switch (`enabled` and `adaptive` on, `disabled` and
`between_tools` off; absent: off, as in Anthropic's API, where thinking is opt-in, whatever
the template's default). `budget_tokens` (enabled thinking only; at least 1024 and less than
max_tokens, as Anthropic checks it) is keyed, not enforced: no runner can cut a thought short,
so it reaches the template as `thinking_budget` (which templates with a budget read) and two
budgets are two entries; the thought ends when the model ends it, within max_tokens. The
canonical request is chat's, so a question asked through chat completions, Responses or
Messages is one cache entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import orjson

from cacheproxy.edge.apis.messages.context import edited
from cacheproxy.edge.apis.messages.tools import tool_choice, tools
from cacheproxy.edge.apis.messages.turns import turns, unknown
from cacheproxy.errors import InvalidRequest, ProxyError, Unsupported
from cacheproxy.keys import fields
from cacheproxy.keys.canonical import Parsed, RunnerDefaults, parse
from cacheproxy.keys.paths import Origin, Paths, renamed
from policies.sampling import SamplingMode

# Fields that change nothing in the answer: accepted, validated, never keyed.
_PASSED = frozenset({"metadata", "service_tier", "speed", "inference_geo", "diagnostics",
                     "user_profile_id", "workspace_id", "cache_control", "stream"})
_APPLIED = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences",
                      "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking",
                      "output_config", "output_format", "context_management"})
_REFUSED = {"container": "runs no code-execution containers",
            "mcp_servers": "connects to no MCP servers (run the tools in the client)"}
# What /v1/messages/count_tokens takes (the SDK's MessageCountTokensParams).
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                          "output_config", "output_format", "cache_control", "speed",
                          "user_profile_id", "workspace_id", "context_management"})
# thinking.display: omitted, or the thought as generated (this server has no summariser, and
# Claude Code's `updates` and `highlights` ask to be shown the thought's progress).
_DISPLAYS = (None, "summarized", "omitted", "updates", "highlights")
# output_config.effort (Anthropic's levels, also a system turn's) -> reasoning_effort ("max":
# the most a template can be asked).
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
# Anthropic documents no bound on stop_sequences (OpenAI's `stop` takes 4); this server's
# keeps the per-token check of each sequence cheap.
MAX_STOP_SEQUENCES = 64
SCHEMA_FIELDS = ("tools", "output_config.format", "output_format")
"""The fields of a Messages body that may carry schemas (counted against the schema budget;
a body with any is parsed off the event loop)."""
# thinking.budget_tokens: Anthropic's least, and the template kwarg it is keyed as (the name
# templates with a thinking budget read, e.g. Seed-OSS's).
_MIN_BUDGET = 1024
THINKING_BUDGET = "thinking_budget"

# Where the chat request's fields came from, for an error a chat check raises (with its tools:
# `_paths`); alone, for one raised while generating. (Its turns are not mapped: a chat turn's
# index is not a Messages turn's.)
PATHS = Paths(prefixes=(("response_format.json_schema", "output_config.format"),
                        ("response_format", "output_config.format"),
                        ("stop", "stop_sequences"), ("reasoning_effort", "output_config.effort"),
                        ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use")))
_TOOL = ((".function.parameters", ".input_schema"), (".function", ""))


def _paths(body: Mapping[str, Any]) -> Paths:
    """PATHS, with each chat tool's Messages tool (a deferred one is not a chat tool) and the
    spelling of the format the request used."""
    shown = [Origin(f"tools[{i}]", _TOOL) for i, tool in enumerate(body.get("tools") or ())
             if not tool.get("defer_loading")]
    if body.get("output_format") is None:
        return replace(PATHS, tools=shown)
    form = (("response_format.json_schema", "output_format"), ("response_format", "output_format"))
    return replace(PATHS, prefixes=(*form, *PATHS.prefixes[2:]), tools=shown)


def _fields(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, [], {}):
            raise Unsupported(f"'{name}' is not supported: this server {why}", param=name)
    for name in body:
        if name not in known and name not in _REFUSED:
            raise Unsupported(f"'{name}' is not a parameter this server's Messages API knows: "
                              "it is refused rather than ignored", param=name)
    fields.obj(body, "metadata")
    fields.obj(body, "diagnostics")
    fields.obj(body, "cache_control")
    for name, allowed in (("service_tier", ("auto", "standard_only")),
                          ("speed", ("standard", "fast"))):
        if body.get(name) not in (None, *allowed):
            raise InvalidRequest(f"'{name}' must be one of {list(allowed)}", param=name)
    for name in ("inference_geo", "user_profile_id", "workspace_id"):
        fields.string(body, name, "")


@dataclass(frozen=True, slots=True)
class Thinking:
    """What `thinking` asks: the template's switch, the thought's budget (keyed), whether the
    thought is shown omitted."""

    switch: bool = False
    budget: int | None = None
    omitted: bool = False


def _budget(raw: Mapping[str, Any], max_tokens: int) -> int:
    """`budget_tokens` of enabled thinking, as Anthropic checks it: at least 1024, less than
    max_tokens."""
    budget, where = raw.get("budget_tokens"), "thinking.budget_tokens"
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise InvalidRequest(f"'{where}' is required with thinking.type enabled, an integer",
                             param=where)
    if not _MIN_BUDGET <= budget < max_tokens:
        raise InvalidRequest(f"'{where}' must be at least {_MIN_BUDGET} and less than "
                             f"max_tokens ({max_tokens}), not {budget}", param=where)
    return budget


def _thinking(body: Mapping[str, Any], max_tokens: int) -> Thinking:
    """What `thinking` asks. Absent is off: in Anthropic's API thinking is opt-in (Claude
    Code's MAX_THINKING_TOKENS=0 leaves the field out), whatever the chat template's own
    default."""
    raw = fields.obj(body, "thinking")
    if not raw:
        return Thinking()
    kind = raw.get("type")
    if kind not in ("enabled", "adaptive", "disabled", "between_tools"):
        raise InvalidRequest("'thinking.type' must be enabled, adaptive, disabled or "
                             "between_tools", param="thinking.type")
    unknown(raw, frozenset({"type", "budget_tokens", "display"}), "thinking")
    if kind != "enabled" and raw.get("budget_tokens") is not None:  # it would be ignored
        raise InvalidRequest(f"'thinking.budget_tokens' is for thinking.type enabled, not "
                             f"{kind}", param="thinking.budget_tokens")
    if raw.get("display") not in _DISPLAYS:
        raise InvalidRequest(f"'thinking.display' must be one of {_DISPLAYS[1:]}",
                             param="thinking.display")
    return Thinking(switch=kind in ("enabled", "adaptive"),
                    budget=_budget(raw, max_tokens) if kind == "enabled" else None,
                    omitted=raw.get("display") == "omitted")


def _effort(config: Mapping[str, Any], where: str) -> str | None:
    """An output_config's effort, checked: one of Anthropic's levels (400 naming `where`)."""
    effort = config.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in _EFFORTS):
        raise InvalidRequest(f"'{where}.effort' must be one of {list(_EFFORTS)}, not "
                             f"{effort!r}", param=f"{where}.effort")
    return effort


def _turn_effort(body: Mapping[str, Any]) -> str | None:
    """The effort the last system turn sets (Claude Code's per-turn control): the answer now
    asked is generated at it; an earlier turn's governed only answers already in the history,
    and is checked all the same."""
    effort = None
    for i, turn in enumerate(body["messages"]):
        if turn.get("output_config") is not None:
            where, config = f"messages[{i}].output_config", turn["output_config"]
            if not isinstance(config, dict):
                raise InvalidRequest(f"'{where}' must be an object", param=where)
            unknown(config, frozenset({"effort"}), where)
            effort = _effort(config, where) or effort
    return effort


def _output(body: Mapping[str, Any], chat: dict[str, Any], thinking: Thinking) -> None:
    """output_config (and the older top-level output_format): format and effort."""
    config = fields.obj(body, "output_config")
    unknown(config, frozenset({"format", "effort"}), "output_config")
    form, where = config.get("format"), "output_config.format"
    if body.get("output_format") is not None:
        if form is not None:
            raise InvalidRequest("give 'output_config.format' or 'output_format', not both",
                                 param="output_format")
        form, where = body["output_format"], "output_format"
    if form is not None:
        if not isinstance(form, dict) or form.get("type") != "json_schema":
            raise InvalidRequest(f"'{where}.type' must be json_schema", param=f"{where}.type")
        unknown(form, frozenset({"type", "schema"}), where)
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": form.get("schema")}}
    asked = _effort(config, "output_config")
    effort = _turn_effort(body) or asked
    kwargs: dict[str, Any] = {"enable_thinking": thinking.switch}
    if thinking.budget is not None:  # keyed (the runner cannot cut a thought short)
        kwargs[THINKING_BUDGET] = thinking.budget
    if effort is not None and thinking.switch is False:  # the level for templates that read it
        kwargs["reasoning_effort"] = _EFFORTS[effort]
    elif effort is not None:
        chat["reasoning_effort"] = _EFFORTS[effort]
    chat["chat_template_kwargs"] = kwargs


def _max_tokens(body: Mapping[str, Any], *, required: bool) -> int | None:
    """The max_tokens asked (None where it may be left out: counting tokens)."""
    wanted = fields.integer(body, "max_tokens", None, lo=1, hi=2**31)
    if wanted is None and required:
        raise InvalidRequest("'max_tokens' is required", param="max_tokens")
    return wanted


def translate(body: Mapping[str, Any], cap: int, *, counting: bool = False
              ) -> tuple[dict[str, Any], bool]:
    """The chat body of a Messages request (`cap`: the most tokens this server generates),
    and whether thinking is shown omitted."""
    _fields(body, COUNT_FIELDS if counting else _APPLIED | _PASSED)
    body = edited(body)
    asked = _max_tokens(body, required=not counting)
    chat: dict[str, Any] = {"messages": turns(body), "max_tokens": min(asked or 1, cap)}
    for name, hi in (("temperature", 1.0), ("top_p", 1.0)):
        if body.get(name) is not None:
            chat[name] = fields.number(body, name, 0.0, lo=0.0, hi=hi)
    for name in ("model", "stream", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = list(fields.stop_list(body, "stop_sequences", most=MAX_STOP_SEQUENCES))
    deferred = tools(body, chat)
    tool_choice(body, chat, deferred)
    thinking = _thinking(body, asked or 2**31)
    _output(body, chat, thinking)
    return chat, thinking.omitted


def parse_messages(body: object, defaults: RunnerDefaults, mode: SamplingMode, *,
                   max_tokens_cap: int | None = None, max_answer_tokens: int | None = None,
                   counting: bool = False) -> Parsed:
    """The canonical request of a Messages body: its chat translation's, so that the APIs
    key the same answer alike; the delivery says the Messages API renders it."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    cap = min(defaults.max_tokens_cap, defaults.context_length, max_tokens_cap or 2**31)
    chat, omitted = translate(body, cap, counting=counting)
    try:
        parsed = parse(chat, "chat", defaults, mode, max_tokens_cap=max_tokens_cap,
                       max_answer_tokens=max_answer_tokens, max_stops=MAX_STOP_SEQUENCES)
    except ProxyError as error:  # a chat check: named as this request names the field
        raise renamed(error, _paths(body)) from None
    echo = orjson.dumps({"omit_thinking": True}) if omitted else b""
    return replace(parsed, delivery=replace(parsed.delivery, api="messages", echo=echo))


def count_messages(body: object, defaults: RunnerDefaults, mode: SamplingMode, *,
                   max_tokens_cap: int | None = None,
                   max_answer_tokens: int | None = None) -> Parsed:
    """The canonical request of a /v1/messages/count_tokens body (it has no max_tokens)."""
    return parse_messages(body, defaults, mode, max_tokens_cap=max_tokens_cap,
                          max_answer_tokens=max_answer_tokens, counting=True)
