"""What this server does with each field of a Responses request, never dropping one.

Every top-level field of openai's `ResponseCreateParams`, and every nested one read here,
falls in one class (a field in none is a 400 naming it):

- translated: applied through the equivalent chat request, so keyed as chat keys it
  (`responses.translate`);
- passed: changes nothing in the answer (it describes the caller, or how the answer is
  delivered): echoed or not, never keyed; its type is still checked;
- moot: asks for something only a feature this server refuses would produce (a value of
  the default, a tool search, a programmatic caller): accepted, never keyed;
- refused: a 400 `unsupported_parameter` naming its path, with why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cacheproxy.errors import InvalidRequest, Unsupported
from cacheproxy.keys import fields
from cacheproxy.keys import tools as tooling
from cacheproxy.keys.canonical import PASSED as CHAT_PASSED

TRANSLATED = frozenset({"model", "stream", "input", "instructions", "tools", "tool_choice",
                        "parallel_tool_calls", "max_output_tokens", "temperature", "top_p",
                        "reasoning", "text", "chat_template_kwargs"})
# `include` is honoured when the answer is rendered (responses_tools.includes); `prediction`
# is chat's own field, which OpenAI's Responses API does not take.
PASSED = (CHAT_PASSED - {"prediction"}) | {"stream_options", "include", "truncation",
                                            "client_metadata"}
_STRINGS = ("user", "safety_identifier", "prompt_cache_key", "service_tier",
            "prompt_cache_retention")
_OBJECTS = ("metadata", "client_metadata", "prompt_cache_options")
# Set to anything but null (`background`: but false), each is a 400 saying why.
REFUSED = {
    "previous_response_id": "this server keeps no responses: send the whole conversation "
                            "as input",
    "conversation": "this server keeps no conversations: send the whole conversation as input",
    "background": "this server answers every request in the foreground",
    "prompt": "this server has no stored prompt templates",
    "max_tool_calls": "this server runs no built-in tools",
    "top_logprobs": "this server's Responses API returns no logprobs (its chat completions do)",
    "context_management": "this server compacts no context: a prompt over the context is a 400",
    "moderation": "this server runs no moderation",
    "prediction": "it belongs to /v1/chat/completions, not the Responses API",
}
_SUMMARIES = {"auto": True, "concise": True, "detailed": True, "none": False}
_REASONING_KEYS = frozenset({"effort", "summary", "generate_summary", "context", "mode"})
_FORMAT_KEYS = {"text": frozenset({"type"}), "json_object": frozenset({"type"}),
                "json_schema": frozenset({"type", "name", "schema", "description", "strict"})}


def check(body: Mapping[str, Any]) -> None:
    """Refuse a field this server does not serve or know; check the passed ones' types."""
    for name, why in REFUSED.items():
        unset = (not fields.boolean(body, name, False) if name == "background"
                 else body.get(name) is None)
        if not unset:
            raise Unsupported(f"'{name}' is not supported: {why}", param=name)
    for name in body:
        if name not in TRANSLATED and name not in PASSED and name not in REFUSED:
            raise Unsupported(f"'{name}' is not supported by this server's Responses API",
                              param=name)
    if fields.boolean(body, "store", False):
        raise Unsupported("'store' true is not supported: this server keeps no responses",
                          param="store")
    if body.get("truncation") not in (None, "disabled"):
        raise Unsupported("'truncation' other than 'disabled' is not supported: a prompt over "
                          "the context is a 400", param="truncation")
    for name in _STRINGS:
        fields.string(body, name, "")
    for name in _OBJECTS:
        fields.obj(body, name)
    fields.stream_options(body, frozenset())  # (usage is always in response.completed)


def reasoning(body: Mapping[str, Any]) -> tuple[str | None, str | None, bool]:
    """(effort, summary as asked, whether a summary is given) of `reasoning`: the effort is
    applied (chat's reasoning_effort); the summary, when asked, is the thought itself."""
    spec = fields.obj(body, "reasoning")
    _known(spec, _REASONING_KEYS, "reasoning")
    effort = spec.get("effort")
    if effort is not None:
        tooling.effort(effort, "reasoning.effort")  # ("max" is "xhigh": the chat form keys it)
    # `generate_summary` is the deprecated spelling of `summary`.
    name = "summary" if spec.get("summary") is not None else "generate_summary"
    summary = spec.get(name)
    if summary is not None and (not isinstance(summary, str) or summary not in _SUMMARIES):
        raise InvalidRequest(f"'reasoning.{name}' must be one of {sorted(_SUMMARIES)}",
                             param=f"reasoning.{name}")
    # The chat template decides which past thoughts the prompt shows: that is "auto".
    _default_only(spec, "context", "auto", "the chat template decides which earlier "
                  "reasoning the prompt shows")
    _default_only(spec, "mode", "standard", "this server has one reasoning mode")
    return effort, summary, bool(summary is not None and _SUMMARIES[summary])


def text_format(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """`text.format` (checked key by key); `text.verbosity` has no chat template control."""
    text = fields.obj(body, "text")
    _known(text, frozenset({"format", "verbosity"}), "text")
    if text.get("verbosity") is not None:
        raise Unsupported("'text.verbosity' is not supported: no chat template takes it",
                          param="text.verbosity")
    form = text.get("format") or {"type": "text"}
    if not isinstance(form, dict):
        raise InvalidRequest("'text.format' must be an object", param="text.format")
    keys = _FORMAT_KEYS.get(str(form.get("type")))
    if keys is None:
        raise InvalidRequest("'text.format.type' must be text, json_object or json_schema",
                             param="text.format.type")
    _known(form, keys, "text.format")
    return form


def tool_choice(raw: object) -> object:
    """The chat form of `tool_choice`: a mode or one function, checked key by key."""
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        _known(raw, frozenset({"type", "name"}), "tool_choice")
        return {"type": "function", "function": {"name": raw.get("name")}}
    raise Unsupported("'tool_choice' must be 'auto', 'none', 'required' or a function "
                      "(allowed_tools and hosted, custom or shell tools are not supported)",
                      param="tool_choice")


def _known(spec: Mapping[str, Any], keys: frozenset[str], where: str) -> None:
    for name in spec:
        if name not in keys:
            raise Unsupported(f"'{where}.{name}' is not supported", param=f"{where}.{name}")


def _default_only(spec: Mapping[str, Any], name: str, default: str, why: str) -> None:
    value = spec.get(name)
    if value is not None and value != default:
        raise Unsupported(f"'reasoning.{name}' other than {default!r} is not supported: {why}",
                          param=f"reasoning.{name}")
