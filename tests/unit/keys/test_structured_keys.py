"""response_format and strict tools in the canonical request and the key: the schema is
canonical (keyword order normalized, properties and enum order kept), that canonical form is
what llguidance compiles, and what it cannot enforce is a 400 naming the construct."""

from __future__ import annotations

import copy
import functools
import json
import random
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher
from pydantic import BaseModel

from cacheproxy.errors import ProxyError, Unsupported
from cacheproxy.keys import grammar
from cacheproxy.keys.canonical import RunnerDefaults, parse
from cacheproxy.keys.key import make_key
from cacheproxy.keys.tools import Tool, schema
from cacheproxy.runners.constrain import Grammars, call_grammar, constraint_for
from policies.sampling import SamplingMode
from tests.unit.keys.test_keys import shuffled
from tests.unit.keys.test_tools import changed

DEFAULTS = RunnerDefaults(model_id="demo", aliases=frozenset(), max_tokens=256,
                          max_tokens_cap=4096, context_length=512, tool_calling=True,
                          tool_format="json_tools", grammar_engine="llguidance 1.9.1")
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["animal", "food", "where"],
    "properties": {
        "animal": {"type": "string", "description": "Its name"},
        "food": {"type": "string", "enum": ["berries", "fish", "mice"]},
        "where": {"type": "object", "properties": {"home": {"type": "string"}},
                  "required": ["home"]},
        "friends": {"type": "array", "items": {"type": "string"}, "minItems": 2}}}
ASK = [{"role": "user", "content": "Tell me about the fox."}]


def body(spec: dict[str, Any] = SCHEMA, **extra: Any) -> dict[str, Any]:
    return {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "Animal", "schema": spec, **extra}}}


def key(request: dict[str, Any], defaults: RunnerDefaults = DEFAULTS) -> str:
    parsed = parse(request, "chat", defaults, SamplingMode.FORCE_GREEDY)
    return make_key(parsed.request, "f" * 32)


def edited(path: list[Any], value: Any) -> dict[str, Any]:
    return changed(path, value, SCHEMA)


def reordered(rnd: random.Random) -> dict[str, Any]:
    """SCHEMA with every keyword order shuffled, the order of its properties kept."""
    spec = shuffled(SCHEMA, rnd)
    spec["properties"] = {name: shuffled(SCHEMA["properties"][name], rnd)
                          for name in SCHEMA["properties"]}
    return spec


@settings(max_examples=40, deadline=None)
@given(rnd=st.randoms(use_true_random=False))
def test_keyword_order_never_splits_a_key(rnd: random.Random) -> None:
    assert key(body(reordered(rnd))) == key(body())


@pytest.mark.parametrize("other", [
    edited(["properties", "animal", "description"], "The animal"),
    edited(["required"], ["animal", "food"]),
    edited(["properties", "food", "enum"], ["fish", "berries", "mice"]),
    {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))},
    edited(["properties", "friends", "minItems"], 3),
], ids=["description", "required", "enum order", "properties order", "minItems"])
def test_what_the_grammar_sees_changes_the_key(other: dict[str, Any]) -> None:
    assert key(body(other)) != key(body())


def test_name_and_strict_change_no_token_and_share_a_key() -> None:
    assert key(body(strict=True)) == key(body(strict=False)) == key(body())
    renamed = body()
    renamed["response_format"]["json_schema"]["name"] = "Other"
    assert key(renamed) == key(body())


def test_formats_are_three_entries() -> None:
    text = {"messages": ASK}
    keys = {key(text), key({**text, "response_format": {"type": "text"}}),
            key({**text, "response_format": {"type": "json_object"}}), key(body())}
    assert len(keys) == 3  # text and absent are one


def test_the_engine_compiles_the_canonical_schema() -> None:
    parsed = parse(body(reordered(random.Random(3))), "chat", DEFAULTS,
                   SamplingMode.FORCE_GREEDY)
    compiled = grammar.answer_grammar(parsed.request.response_format)
    expected = LLMatcher.grammar_from_json_schema(schema(SCHEMA), defaults=grammar.COMPACT)
    assert compiled == expected
    assert json.loads(parsed.request.response_format)["schema"] == schema(SCHEMA)


@pytest.mark.parametrize(("spec", "construct"), [
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "not": {"required": ["a"]}}, "not"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
])
def test_what_llguidance_cannot_enforce_is_refused_naming_it(spec: dict[str, Any],
                                                              construct: str) -> None:
    with pytest.raises(Unsupported) as info:
        key(body(spec))
    assert info.value.param == "response_format.json_schema.schema"
    assert construct in info.value.message


@pytest.mark.parametrize(("request_body", "param"), [
    ({"messages": ASK, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": ASK, "response_format": "json"}, "response_format"),
    (body({"type": "strin"}), "response_format.json_schema.schema"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "schema": SCHEMA}}}, "response_format.json_schema.name"),
])
def test_malformed_formats_are_400s_naming_the_field(request_body: dict[str, Any],
                                                     param: str) -> None:
    with pytest.raises(ProxyError) as info:
        key(request_body)
    assert info.value.status == 400 and info.value.param == param


WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}


def test_strict_tools_are_keyed_and_checked() -> None:
    plain = copy.deepcopy(WEATHER)
    del plain["function"]["strict"]
    assert key({"messages": ASK, "tools": [WEATHER]}) != key({"messages": ASK, "tools": [plain]})
    bad = copy.deepcopy(WEATHER)
    bad["function"]["parameters"]["properties"]["city"]["pattern"] = "(?!x)"
    with pytest.raises(Unsupported) as info:
        key({"messages": ASK, "tools": [bad]})
    assert info.value.param == "tools[0].function.parameters"


def test_a_runner_that_cannot_constrain_refuses_rather_than_ignores() -> None:
    upstream = RunnerDefaults(model_id="demo", aliases=frozenset(), max_tokens=256,
                              max_tokens_cap=4096, context_length=512, tool_calling=True,
                              tool_format="json_tools")
    for request_body, param in ((body(), "response_format"),
                                ({"messages": ASK, "tools": [WEATHER]}, "tools")):
        with pytest.raises(Unsupported) as info:
            key(request_body, upstream)
        assert info.value.param == param and "cannot guarantee" in info.value.message


def test_response_format_with_tools_is_refused() -> None:
    with pytest.raises(Unsupported) as info:
        key({**body(), "tools": [WEATHER]})
    assert info.value.param == "response_format"


# The call grammar a strict tool gets, run on the demo model's tokenizer.


class _Inner(BaseModel):
    x: int


class _Booking(BaseModel):
    """Pydantic writes a nested model as a `$defs` entry and a `#/$defs/...` reference."""

    inner: _Inner


def _tokenizer() -> Any:
    from mlx_lm.tokenizer_utils import load

    from cacheproxy.runners.demo.model import BUNDLED_MODEL

    return load(BUNDLED_MODEL)


def _consumes(matcher: Any, tokenizer: Any, text: str) -> bool:
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_a_strict_tool_with_references_gets_a_call_grammar_that_holds() -> None:
    booking = openai.pydantic_function_tool(_Booking, name="book")
    assert "$defs" in booking["function"]["parameters"]
    tools = [booking, {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    parsed = parse({"messages": ASK, "tools": tools}, "chat", DEFAULTS,
                   SamplingMode.FORCE_GREEDY)  # no 400: the references resolve
    tok = _tokenizer()
    grammars = Grammars(tok, len(tok.vocab))
    call = call_grammar(grammar.call_schema(parsed.request.tools), named=None)
    good = '\n{"name": "book", "arguments": {"inner": {"x": 3}}}\n'
    assert _consumes(grammars.matcher(call), tok, good)
    assert not _consumes(grammars.matcher(call), tok, good.replace("3", '"3"'))
    free = '\n{"name": "get_time", "arguments": {"anything": true}}\n'
    assert _consumes(grammars.matcher(call), tok, free)  # not strict: any object


def test_a_compiled_grammar_is_reused_only_in_the_scope_that_compiled_it() -> None:
    """Per-key scope (#34): tenant b's request never finds the grammar tenant a's compiled
    (no request is faster for a schema another tenant sent); within a scope it is reused."""
    tok = _tokenizer()
    grammars = Grammars(tok, len(tok.vocab))
    text = grammar.answer_grammar(grammar.response_format({"response_format": {
        "type": "json_schema", "json_schema": {"name": "pin", "schema": {
            "type": "object", "properties": {"pin": {"const": "4817"}}}}}}))
    grammars.matcher(text, scope="a")
    grammars.matcher(text, scope="a")
    assert len(grammars) == 1  # reused within a
    grammars.matcher(text, scope="b")
    assert len(grammars) == 2  # compiled again for b (the control: a's was there)
    grammars.forget(text, scope="a")
    assert len(grammars) == 1


def test_whether_a_schema_compiles_is_never_remembered_across_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(#34) A tool that is not strict is held to its schema when llguidance can enforce it;
    that check compiles the schema every time. Remembered by schema text (process-wide), a
    tenant's check was instant for a schema another tenant had sent: timing told it so."""
    compiled: list[str] = []
    compile_schema = grammar.schema_grammar

    def counted(canonical: Any, param: str) -> str:
        compiled.append(json.dumps(canonical))
        return compile_schema(canonical, param)

    monkeypatch.setattr(grammar, "schema_grammar", counted)
    tool = Tool("pin", None, json.dumps({"type": "object", "properties": {
        "pin": {"const": "4817"}}}))
    assert grammar.enforceable(tool) and grammar.enforceable(tool)  # tenant a, then b
    assert len(compiled) == 2  # each paid for its own compile
    remembered = functools.lru_cache(grammar.enforceable)  # control: a memo shows as one
    assert remembered(tool) and remembered(tool)
    assert len(compiled) == 3
    assert grammar.enforceable(Tool("s", None, tool.parameters, strict=True))
    assert len(compiled) == 3  # (a strict tool's schema is checked at parse, 400 if not)


def test_a_call_opened_while_thinking_is_held_to_the_grammar() -> None:
    import mlx.core as mx

    tok = _tokenizer()
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    request = parse({"messages": ASK, "tools": [strict]}, "chat", DEFAULTS,
                    SamplingMode.FORCE_GREEDY).request
    constraint = constraint_for(Grammars(tok, len(tok.vocab)), tok, request, "", "reasoning")
    assert constraint is not None
    prompt = tok.encode("<|assistant|>\n<think>", add_special_tokens=False)
    thought = tok.encode("I look it up.<tool_call>", add_special_tokens=False)
    logits = mx.zeros((1, len(tok.vocab)))
    tokens = list(prompt)
    constraint(mx.array(tokens), logits)
    for token in thought:
        tokens.append(token)
        masked = constraint(mx.array(tokens), logits)
    assert bool(mx.isinf(masked).any())  # the call is masked from its first token on
