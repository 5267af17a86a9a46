"""Tools, tool_choice, parallel_tool_calls and chat_template_kwargs: validated, canonical.

A function tool's keys are openai's (`type`, `function`: `name`, `description`, `parameters`,
`strict`; a legacy `functions` entry: the first three), each applied; any other is a 400
naming its path (`tools[i].key`, `tools[i].function.key`), never dropped.

Canonical JSON: keyword order inside JSON objects carries no meaning and is sorted, and
whitespace is gone, except where order is meaning: the order of a schema's `properties`
(the order of the output), of `enum` values and of every list is kept, and so is the key
order of data a model wrote (tool-call arguments). Integral floats become integers. The
canonical form is what the chat template renders and what the key hashes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from cacheproxy.errors import InvalidRequest, Unsupported
from cacheproxy.keys import fields

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Schema keywords whose value maps a name to a schema in an order that means something.
_ORDERED_MAPS = frozenset({"properties", "patternProperties"})
_SCHEMA_MAPS = frozenset({"$defs", "definitions", "dependentSchemas"})
_SCHEMA_VALUES = frozenset({"items", "additionalProperties", "not", "if", "then", "else",
                            "contains", "propertyNames", "unevaluatedItems",
                            "unevaluatedProperties", "additionalItems"})
_SCHEMA_LISTS = frozenset({"anyOf", "allOf", "oneOf", "prefixItems"})
# apply_chat_template's own arguments (transformers' signature, checked by a test): a template
# kwarg of that name would be taken as the argument (truncation, return_tensors...).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})
# The keys of openai's ChatCompletionFunctionToolParam, FunctionDefinition and the legacy
# `functions` entry (completion_create_params.Function): each applied; any other is a 400.
# (LangChain, instructor, llm and litellm send these and no others.)
TOOL_KEYS = frozenset({"type", "function"})
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
LEGACY_KEYS = frozenset({"name", "description", "parameters"})
# reasoning_effort (chat) / reasoning.effort (Responses): whether the template thinks at all.
EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
           "xhigh": True}
# openai's "max" (its ReasoningEffort has it) is the most a template can be asked: "xhigh", as
# Anthropic's `max` is (Messages). One key and one prompt for the two spellings.
EFFORT_ALIASES = {"max": "xhigh"}


def effort(value: object, param: str) -> str:
    """A reasoning effort as the template is asked it ("max" is "xhigh"); 400 naming `param`
    and the efforts there are for any other."""
    if not isinstance(value, str) or value not in EFFORTS | EFFORT_ALIASES:
        known = [*EFFORTS, *EFFORT_ALIASES]
        raise InvalidRequest(f"'{param}' must be one of {known} (max is xhigh: the most a "
                             "template can be asked)", param=param)
    return EFFORT_ALIASES.get(value, value)


def number(value: Any) -> Any:
    """An integral float as an int (1.0 and 1 are one JSON number); anything else as is."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def data(value: Any) -> Any:
    """JSON data in canonical form: object keys sorted, lists in order, numbers normalized."""
    if isinstance(value, dict):
        return {k: data(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [data(v) for v in value]
    return number(value)


def ordered(value: Any) -> Any:
    """JSON data with the key order kept (data a model wrote): numbers normalized."""
    if isinstance(value, dict):
        return {k: ordered(v) for k, v in value.items()}
    if isinstance(value, list):
        return [ordered(v) for v in value]
    return number(value)


def schema(value: Any) -> Any:
    """A JSON schema in canonical form (see the module docstring)."""
    if isinstance(value, list):
        return [schema(v) for v in value]
    if not isinstance(value, dict):
        return number(value)
    out: dict[str, Any] = {}
    for key in sorted(value):
        item = value[key]
        if key in _ORDERED_MAPS and isinstance(item, dict):
            out[key] = {name: schema(sub) for name, sub in item.items()}
        elif key in _SCHEMA_MAPS and isinstance(item, dict):
            out[key] = {name: schema(item[name]) for name in sorted(item)}
        elif key in _SCHEMA_VALUES or key in _SCHEMA_LISTS:
            out[key] = schema(item)
        elif key == "required" and isinstance(item, list) and all(
                isinstance(r, str) for r in item):
            out[key] = sorted(set(item))  # a set of names: order and repeats mean nothing
        else:
            out[key] = data(item)  # enum, const, default, examples, type, description...
    return out


def dumps(value: Any) -> str:
    """Compact JSON text of already canonical data."""
    return orjson.dumps(value).decode()


def check_schema(value: Any, where: str) -> None:
    """400 naming `where` unless `value` is a valid JSON schema (Draft 2020-12)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(value, dict):
        raise InvalidRequest(f"'{where}' must be a JSON schema object", param=where)
    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise InvalidRequest(f"'{where}' is not a valid JSON schema: {exc.message}"
                             + (f" (at {path})" if path else ""), param=where) from None


@dataclass(frozen=True, slots=True)
class Tool:
    """One function tool: name, description, parameters (canonical JSON text), strict."""

    name: str
    description: str | None
    parameters: str
    strict: bool | None = None

    def for_template(self) -> dict[str, Any]:
        """The OpenAI tool object the chat template (and tool parsers) receive."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = orjson.loads(self.parameters)
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


def _function(raw: object, where: str, keys: frozenset[str] = FUNCTION_KEYS) -> Tool:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    _known(raw, keys, where)
    name = raw.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest(f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'",
                             param=f"{where}.name")
    description = raw.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"'{where}.description' must be a string",
                             param=f"{where}.description")
    parameters = raw.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}  # OpenAI: no parameters
    check_schema(parameters, f"{where}.parameters")
    if parameters.get("type", "object") != "object":
        raise InvalidRequest(f"'{where}.parameters' must describe an object",
                             param=f"{where}.parameters")
    # strict false is no constraint, as when it is absent: one spelling, not rendered.
    strict = fields.boolean(raw, "strict", False) or None
    return Tool(name, description, dumps(schema(parameters)), strict)


def tools(body: Mapping[str, Any]) -> tuple[tuple[Tool, ...], bool]:
    """The function tools (from `tools`, or the legacy `functions`) and whether legacy."""
    raw, legacy = body.get("tools"), body.get("functions")
    if raw is not None and legacy is not None:
        raise InvalidRequest("give 'tools' or the legacy 'functions', not both",
                             param="functions")
    if legacy is not None:
        if not isinstance(legacy, list):
            raise InvalidRequest("'functions' must be a list", param="functions")
        out = tuple(_function(f, f"functions[{i}]", LEGACY_KEYS)
                    for i, f in enumerate(legacy))
        return _unique(out, "functions"), True
    if raw is None:
        return (), False
    if not isinstance(raw, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    found = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        if tool.get("type", "function") != "function":
            raise Unsupported(f"'{where}.type' {tool.get('type')!r}: only function tools are "
                              "supported", param=f"{where}.type")
        _known(tool, TOOL_KEYS, where)
        found.append(_function(tool.get("function"), f"{where}.function"))
    return _unique(tuple(found), "tools"), False


def _known(spec: Mapping[str, Any], keys: frozenset[str], where: str) -> None:
    for name in spec:
        if name not in keys:
            raise Unsupported(f"'{where}.{name}' is not a key of a function tool this server "
                              "knows: it is refused rather than ignored",
                              param=f"{where}.{name}")


def _unique(found: tuple[Tool, ...], where: str) -> tuple[Tool, ...]:
    names = [t.name for t in found]
    for name in names:
        if names.count(name) > 1:
            raise InvalidRequest(f"'{where}' names the function {name!r} twice", param=where)
    return found


def tool_choice(body: Mapping[str, Any], offered: tuple[Tool, ...], legacy: bool
                ) -> tuple[str, str]:
    """(mode, function name): mode "auto", "none", "required" or "function" (then named)."""
    field = "function_call" if legacy else "tool_choice"
    if not legacy and body.get("function_call") is not None:
        raise InvalidRequest("'function_call' goes with the legacy 'functions'; with 'tools' "
                             "use 'tool_choice'", param="function_call")
    raw = body.get(field)
    if raw is None:
        return ("auto" if offered else "none"), ""
    if raw in ("auto", "none", "required") and not (legacy and raw == "required"):
        if raw != "none" and not offered:
            raise InvalidRequest(f"'{field}' {raw!r} needs tools", param=field)
        return str(raw), ""
    name = _named(raw, legacy)
    if name is None:
        allowed = "'auto', 'none'" + ("" if legacy else ", 'required'")
        raise InvalidRequest(f"'{field}' must be {allowed} or name a function", param=field)
    if name not in {t.name for t in offered}:
        raise InvalidRequest(f"'{field}' names the function {name!r}, which is not among "
                             "the tools", param=field)
    return "function", name


def _named(raw: object, legacy: bool) -> str | None:
    if not isinstance(raw, dict):
        return None
    if legacy:
        name = raw.get("name")
    else:
        function = raw.get("function")
        if raw.get("type") != "function" or not isinstance(function, dict):
            return None
        name = function.get("name")
    return name if isinstance(name, str) else None


def template_kwargs(body: Mapping[str, Any], defaults: Mapping[str, Any],
                    thinking: str = "enable_thinking") -> str:
    """chat_template_kwargs over the runner's template defaults, as canonical JSON text.
    `enable_thinking` is keyed by the name the template knows it by (`thinking`), as mlx-lm
    renames it, so that the two spellings are one key and one prompt."""
    given = dict(fields.obj(body, "chat_template_kwargs"))
    for name in given:
        if name in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequest(f"'chat_template_kwargs.{name}' is set by the request "
                                 "itself, not as a template option",
                                 param="chat_template_kwargs")
    if thinking != "enable_thinking" and "enable_thinking" in given:
        switch = given.pop("enable_thinking")
        if given.setdefault(thinking, switch) != switch:
            raise InvalidRequest(f"'chat_template_kwargs.enable_thinking' and '{thinking}' "
                                 f"disagree (this template calls it {thinking})",
                                 param="chat_template_kwargs")
    if body.get("reasoning_effort") is not None:
        # Both spellings reach the template: the switch for templates that turn thinking
        # on and off, reasoning_effort for those that read the level.
        level = effort(body["reasoning_effort"], "reasoning_effort")
        if given.get(thinking, EFFORTS[level]) != EFFORTS[level]:
            raise InvalidRequest(f"'reasoning_effort' and chat_template_kwargs.{thinking} "
                                 "disagree", param="reasoning_effort")
        given |= {thinking: EFFORTS[level], "reasoning_effort": level}
    return dumps(data({**defaults, **given}))
