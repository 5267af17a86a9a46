"""The schema budget (keys/budget.py): which bodies carry schemas, and each bound counted
and named."""

from __future__ import annotations

from typing import Any

import pytest

from cacheproxy.edge.apis import APIS
from cacheproxy.errors import SchemaTooComplex
from cacheproxy.keys.budget import SchemaBudget, carries_schemas, check


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def test_only_bodies_with_schema_fields_carry_schemas() -> None:
    assert not carries_schemas({"messages": [{"role": "user", "content": "tools"}]})
    assert not carries_schemas({"tools": None}) and not carries_schemas([1])
    assert carries_schemas({"tools": []}) and carries_schemas({"text": {"format": {}}})


def test_each_api_names_its_schema_fields_a_dotted_name_inside_an_object() -> None:
    messages = APIS["messages"].schema_fields
    form = {"output_config": {"format": {"type": "json_schema", "schema": {
        "properties": {"a": {}, "b": {}, "c": {}}}}}}
    assert carries_schemas(form, messages) and carries_schemas({"output_format": {}}, messages)
    assert not carries_schemas({"output_config": {"effort": "high"}}, messages)
    assert not carries_schemas({"output_config": "format"}, messages)
    with pytest.raises(SchemaTooComplex) as refused:
        check(form, SchemaBudget(max_properties=2), messages)
    assert refused.value.param == "output_config.format"
    # Control: chat's fields are not a Messages body's, so its format would go uncounted.
    assert not carries_schemas(form, APIS["chat"].schema_fields)
    check(form, SchemaBudget(max_properties=2), APIS["chat"].schema_fields)


# (response_format's schema sits 3 levels deep: response_format, json_schema, schema.)
@pytest.mark.parametrize(("body", "limit", "param"), [
    ({"tools": [{}] * 3}, "2 tools", "tools"),
    ({"functions": [{}] * 3}, "2 functions", "functions"),
    (_format({"properties": {"a": {}, "b": {}, "c": {}}}), "2 properties", "response_format"),
    (_format({"enum": [1, 2], "properties": {"a": {"const": 1}}}), "2 enum values",
     "response_format"),
    (_format({"a": {"b": {"c": {"d": {}}}}}), "nests 7 levels", "response_format"),
    (_format({"description": "x" * 300}), "256 bytes", "response_format"),
])
def test_each_bound_is_a_400_naming_it(body: dict[str, Any], limit: str, param: str) -> None:
    budget = SchemaBudget(max_bytes=256, max_properties=2, max_enum_values=2, max_tools=2,
                          max_depth=6)
    with pytest.raises(SchemaTooComplex) as refused:
        check(body, budget)
    assert limit in str(refused.value) and refused.value.param == param
    # Control: the same body within a budget one notch roomier passes.
    check(body, SchemaBudget(max_bytes=512, max_properties=3, max_enum_values=3, max_tools=3,
                             max_depth=7))


def test_a_schema_nested_past_the_interpreter_stack_is_counted() -> None:
    deep: dict[str, Any] = {}
    for _ in range(5000):  # deeper than a recursive walk could go
        deep = {"items": deep}
    with pytest.raises(SchemaTooComplex, match="64 levels"):
        check(_format(deep), SchemaBudget(max_bytes=1 << 20))
    shallow: dict[str, Any] = {}
    for _ in range(100):  # deeper than the budget, not than orjson: counted by the walk
        shallow = {"items": shallow}
    with pytest.raises(SchemaTooComplex, match="nests 103 levels deep"):
        check(_format(shallow), SchemaBudget(max_bytes=1 << 20))
