"""Structured outputs: `response_format` and strict tools, as grammars for llguidance.

A grammar is built from the canonical schema (so what the engine compiles is what the key
hashes) with compact JSON: `", "` and `": "` separators and no free whitespace, as
`json.dumps` writes it (free whitespace lets a small model loop on spaces). llguidance
refuses what it cannot enforce (`uniqueItems`, `not`, `if`/`then`, look-around in a
`pattern`...), and so does this proxy, with a 400 naming the construct: a schema is
either guaranteed or refused, never half applied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from cacheproxy.errors import InvalidRequest, Unsupported
from cacheproxy.keys import fields
from cacheproxy.keys.tools import NAME, Tool, check_schema, dumps, schema

ENGINE = "llguidance"
COMPACT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def engine_version() -> str:
    """`llguidance <version>`: joins the fingerprint (a new engine can change answers)."""
    return f"{ENGINE} {metadata.version(ENGINE)}"


def _checked(grammar: str, param: str) -> str:
    from llguidance import LLMatcher, LLParserLimits

    quiet = LLParserLimits(verbose_errors=False)  # no parser state in a client's error
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=quiet)
    if is_error:
        reason = plain(messages[0])
        raise Unsupported(f"'{param}' cannot be enforced: {reason}", param=param)
    return grammar


def plain(message: str) -> str:
    """An llguidance error without its markup (a quiet error ends in `<non-verbose/>`)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return " ".join(line for line in lines if not line.startswith("<"))[:300] or "refused"


def schema_grammar(canonical: Mapping[str, Any], param: str) -> str:
    """The grammar of one JSON schema; 400 for a construct llguidance cannot enforce."""
    from llguidance import LLMatcher

    return _checked(LLMatcher.grammar_from_json_schema(dict(canonical), defaults=COMPACT), param)


def response_format(body: Mapping[str, Any]) -> str:
    """The canonical response_format as JSON text: "" for text (the default)."""
    raw = body.get("response_format")
    if raw is None:
        return ""
    if not isinstance(raw, dict):
        raise InvalidRequest("'response_format' must be an object", param="response_format")
    kind = raw.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        return dumps({"type": "json_object"})
    if kind != "json_schema":
        raise InvalidRequest("'response_format.type' must be text, json_object or json_schema",
                             param="response_format.type")
    spec = fields.obj(raw, "json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest("'response_format.json_schema.name' must be 1 to 64 letters, "
                             "digits, '_' or '-'", param="response_format.json_schema.name")
    fields.boolean(spec, "strict", False)  # enforced either way: the schema is guaranteed
    where = "response_format.json_schema.schema"
    check_schema(spec.get("schema"), where)
    canonical = schema(spec["schema"])
    schema_grammar(canonical, where)
    # The name and strict change no token: only the schema is keyed (and compiled).
    return dumps({"type": "json_schema", "schema": canonical})


def answer_grammar(canonical_format: str) -> str:
    """The grammar of an answer in this (canonical, non-text) response_format."""
    spec = json.loads(canonical_format)
    if spec["type"] == "json_object":
        return schema_grammar({"type": "object"}, "response_format")
    return schema_grammar(spec["schema"], "response_format.json_schema.schema")


def enforceable(tool: Tool) -> bool:
    """Whether the engine can hold a tool's arguments to its schema (strict ones must be).
    Compiled every time, never remembered: a process-wide memo by schema text answered at
    once for a schema any client had sent before, so under per-key scope a tenant could
    tell by timing whether another had sent it (#34). Its cost is the schema's own."""
    if tool.strict is True:
        return True
    try:
        schema_grammar(json.loads(tool.parameters), "tools")
    except Unsupported:
        return False
    return True


def call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """The JSON of one call of any offered tool, `{"name": ..., "arguments": ...}`, its
    arguments held to the tool's schema wherever the engine can enforce it (always for a
    strict tool; otherwise any JSON object). A tool's local references (`#/$defs/X`, as
    Pydantic writes them) are re-rooted where its schema now sits."""
    options = []
    for i, tool in enumerate(tools):
        root = f"#/anyOf/{i}/properties/arguments" if len(tools) > 1 else \
            "#/properties/arguments"
        arguments = _rooted(json.loads(tool.parameters), root) if enforceable(tool) else \
            {"type": "object"}
        options.append({"type": "object", "additionalProperties": False,
                        "required": ["name", "arguments"],
                        "properties": {"name": {"const": tool.name}, "arguments": arguments}})
    return {"anyOf": options} if len(options) > 1 else options[0]


def _rooted(value: Any, root: str) -> Any:
    if isinstance(value, list):
        return [_rooted(v, root) for v in value]
    if not isinstance(value, dict):
        return value
    ref = value.get("$ref")
    moved = {k: _rooted(v, root) for k, v in value.items()}
    if isinstance(ref, str) and ref.startswith("#"):
        moved["$ref"] = root + ref[1:]
    return moved


def check_strict(tools: tuple[Tool, ...]) -> None:
    """400 unless every strict tool's parameters can be enforced, alone (a named call) and
    in the grammar of a call of any offered tool."""
    for i, tool in enumerate(tools):
        if tool.strict:
            schema_grammar(json.loads(tool.parameters), f"tools[{i}].function.parameters")
    schema_grammar(call_schema(tools), "tools")
