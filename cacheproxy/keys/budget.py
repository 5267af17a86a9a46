"""What one request's schemas may cost to check: counted before any is checked or compiled.

Checking a schema (jsonschema's `check_schema`, llguidance's validation) costs time in
proportion to its size, and both hold the interpreter while they run: a 10,000-property
`response_format` took 4.3 s. So the parts of a body that carry schemas (each API names its
own: chat's `tools`, `functions`, `response_format`, Responses' `tools` and `text`, Messages'
`tools`, `output_config.format` and `output_format`) are counted first, in one walk without
recursion, and a request over any bound is a 400 `schema_too_complex` naming the bound.
The defaults follow OpenAI's own structured-output limits (5,000 properties, 1,000 enum
values, 128 tools) and leave the nesting generous (JSON depth, not schema levels).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from cacheproxy.errors import SchemaTooComplex

SchemaFields = tuple[str, ...]
"""The fields of an API's bodies that may carry JSON schemas; a dotted name is a field of an
object field (`output_config.format`)."""
SCHEMA_FIELDS: SchemaFields = ("tools", "functions", "response_format", "text")
"""Those of the OpenAI APIs (chat, legacy functions, Responses): the default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaBudget:
    """The bounds of one request's schemas (see the module docstring)."""

    max_bytes: int = 256 << 10  # of the schema-carrying fields, as compact JSON
    max_properties: int = 5000  # object properties, all schemas together
    max_enum_values: int = 1000  # enum and const values, all schemas together
    max_tools: int = 128  # tools (or functions) offered
    max_depth: int = 64  # JSON nesting of a schema-carrying field


def _at(body: Mapping[str, Any], name: str) -> object:
    """The value of a (dotted) field, None where it or an object on its way is missing."""
    value: object = body
    for part in name.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def carries_schemas(body: object, fields: SchemaFields = SCHEMA_FIELDS) -> bool:
    """Whether a decoded body has a field that may carry a schema (the expensive parse)."""
    return isinstance(body, dict) and any(_at(body, name) is not None for name in fields)


def check(body: Mapping[str, Any], budget: SchemaBudget,
          fields: SchemaFields = SCHEMA_FIELDS) -> None:
    """400 `schema_too_complex` when the body's schemas (in `fields`) go over any bound of
    `budget`."""
    parts = {name: value for name in fields if (value := _at(body, name)) is not None}
    try:
        size = len(orjson.dumps(parts))
    except TypeError:  # (orjson's own bound: 255 levels)
        raise _over("it nests deeper than 255 levels", f"{budget.max_depth} levels",
                    next(iter(parts))) from None
    if size > budget.max_bytes:
        raise _over(f"its schemas take {size} bytes", f"{budget.max_bytes} bytes",
                    next(iter(parts), "tools"))
    for name in ("tools", "functions"):
        offered = parts.get(name)
        if isinstance(offered, list) and len(offered) > budget.max_tools:
            raise _over(f"it offers {len(offered)} {name}", f"{budget.max_tools} {name}", name)
    properties = enums = 0
    for name, value in parts.items():
        depth, found_properties, found_enums = _count(value)
        if depth > budget.max_depth:
            raise _over(f"'{name}' nests {depth} levels deep", f"{budget.max_depth} levels",
                        name)
        properties, enums = properties + found_properties, enums + found_enums
        if properties > budget.max_properties:
            raise _over(f"its schemas have {properties}+ properties",
                        f"{budget.max_properties} properties", name)
        if enums > budget.max_enum_values:
            raise _over(f"its schemas have {enums}+ enum values",
                        f"{budget.max_enum_values} enum values", name)


def _count(value: object) -> tuple[int, int, int]:
    """(deepest nesting, object properties, enum and const values) of a JSON value, walked
    with a stack (a schema nested thousands deep cannot exhaust the interpreter's)."""
    deepest = properties = enums = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            found = item.get("properties")
            if isinstance(found, dict):
                properties += len(found)
            listed = item.get("enum")
            if isinstance(listed, list):
                enums += len(listed)
            if "const" in item:
                enums += 1
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
    return deepest, properties, enums


def _over(what: str, limit: str, param: str) -> SchemaTooComplex:
    return SchemaTooComplex(f"the request's schemas are over this server's budget: {what}, "
                            f"over the limit of {limit}", param=param)
