"""Cache keys: equivalent requests share a key, output-affecting changes never do."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from itertools import pairwise
from typing import Any

import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cacheproxy.errors import Unsupported
from cacheproxy.keys.canonical import ROLES, Endpoint, RunnerDefaults, parse
from cacheproxy.keys.fingerprint import UNDIGESTED, Fingerprint
from cacheproxy.keys.key import CacheKey, make_key
from policies.sampling import SamplingMode

# The roles a turn of plain text takes (tool turns answer a call: tests/unit/keys/test_tools.py).
TEXT_ROLES = sorted(r for r, canonical in ROLES.items() if canonical != "tool")

DEFAULTS = RunnerDefaults(
    model_id="demo",
    aliases=frozenset({"/path/demo"}),
    max_tokens=256,
    max_tokens_cap=4096,
    context_length=512,
)
FINGERPRINT = Fingerprint(
    engine="mlx-lm",
    engine_version="0.0.1",
    mlx_version="0.0.2",
    model_id="demo",
    model_path="/path/demo",
    weights_digest="w" * 32,
    quantization={"bits": 4, "group_size": 64, "mode": "affine", "dtype": "float16"},
    config_digest="c" * 32,
    tokenizer_digest="t" * 32,
    chat_template_digest="j" * 32,
    adapter_digest="",
    device="cpu",
)
KEY_SHAPE = re.compile(r"[0-9a-f]{32}/[0-9a-f]{32}")
SEEDED = SamplingMode.SEEDED
SOME = settings(max_examples=60, deadline=None)
CHAT = {"messages": [{"role": "user", "content": "Hello there"}]}
SAMPLED = {**CHAT, "temperature": 0.7, "seed": 1}


def key(body: dict[str, Any], endpoint: Endpoint = "chat", mode: SamplingMode = SEEDED) -> str:
    """The cache key of a request body under the test defaults and fingerprint."""
    return make_key(parse(body, endpoint, DEFAULTS, mode).request, FINGERPRINT.digest)


def floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


texts = st.text(max_size=12)
stops = st.lists(st.text(min_size=1, max_size=4), max_size=4)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(TEXT_ROLES), "content": texts}),
    min_size=1,
    max_size=3,
)
COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["demo", "/path/demo"]),
    "max_tokens": st.integers(1, 512),
    "temperature": floats(0, 2),
    "top_p": floats(0, 1),
    "top_k": st.integers(0, 1000),
    "min_p": floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": stops | st.text(min_size=1, max_size=4),
    "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2),
    "repetition_penalty": floats(0.01, 10),
    "logit_bias": st.dictionaries(st.integers(0, 767).map(str), floats(-100, 100), max_size=3),
    "stream": st.booleans(),
    "user": texts,
}
chat_bodies = st.fixed_dictionaries(
    {"messages": messages},
    optional={**COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)},
)
completion_bodies = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=20)},
    optional={**COMMON, "logprobs": st.integers(0, 5)},
)
requests = st.tuples(st.just("chat"), chat_bodies) | st.tuples(
    st.just("completions"), completion_bodies
)


def shuffled(value: Any, rnd: random.Random) -> Any:
    """The same JSON value with every object's keys in a random order."""
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: shuffled(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rnd) for v in value]
    return value


# (a) The wire form of the JSON does not matter.


@SOME
@given(
    request=requests,
    rnd=st.randoms(use_true_random=False),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]),
    indent=st.sampled_from([None, 0, 2, "\t"]),
    ensure_ascii=st.booleans(),
)
def test_key_ignores_key_order_and_whitespace(
    request: tuple[Endpoint, dict[str, Any]],
    rnd: random.Random,
    separators: tuple[str, str],
    indent: int | str | None,
    ensure_ascii: bool,
) -> None:
    endpoint, body = request
    text = json.dumps(
        shuffled(body, rnd), separators=separators, indent=indent, ensure_ascii=ensure_ascii
    )
    reparsed = orjson.loads(f" \n{text}\t\r\n")
    assert key(reparsed, endpoint) == key(orjson.loads(json.dumps(body)), endpoint)


@SOME
@given(request=requests)
def test_key_shape(request: tuple[Endpoint, dict[str, Any]]) -> None:
    endpoint, body = request
    k = key(body, endpoint)
    assert KEY_SHAPE.fullmatch(k)
    assert CacheKey(k).namespace == FINGERPRINT.digest


def test_the_logged_key_part_tells_entries_of_one_namespace_apart() -> None:
    a, b = key(CHAT), key({"messages": [{"role": "user", "content": "Bye"}]})
    assert isinstance(a, CacheKey) and a.namespace == b.namespace
    assert a.short == a.request_hash[:12] == a.split("/")[1][:12] and a.short != b.short


# (b) Aliases and parameters that cannot change the answer share a key.


@SOME
@given(n=st.integers(1, 512))
def test_max_completion_tokens_is_max_tokens(n: int) -> None:
    assert key({**CHAT, "max_completion_tokens": n}) == key({**CHAT, "max_tokens": n})


def test_default_max_tokens_is_explicit_default() -> None:
    assert key(CHAT) == key({**CHAT, "max_tokens": DEFAULTS.max_tokens})


@SOME
@given(stop=st.text(min_size=1, max_size=8))
def test_string_stop_is_one_element_list(stop: str) -> None:
    assert key({**CHAT, "stop": stop}) == key({**CHAT, "stop": [stop]})


@SOME
@given(
    stop=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=4, unique=True),
    rnd=st.randoms(use_true_random=False),
    data=st.data(),
)
def test_stop_order_and_duplicates_do_not_matter(
    stop: list[str], rnd: random.Random, data: st.DataObject
) -> None:
    extra = data.draw(st.lists(st.sampled_from(stop), max_size=4 - len(stop)))
    other = stop + extra
    rnd.shuffle(other)
    assert key({**CHAT, "stop": other}) == key({**CHAT, "stop": stop})


@SOME
@given(content=st.text(max_size=30), data=st.data())
def test_string_content_is_list_of_text_parts(content: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(content)), max_size=4)))
    bounds = [0, *cuts, len(content)]
    parts = [{"type": "text", "text": content[a:b]} for a, b in pairwise(bounds)]
    as_parts = {"messages": [{"role": "user", "content": parts}]}
    assert key(as_parts) == key({"messages": [{"role": "user", "content": content}]})


def test_developer_role_is_system() -> None:
    def with_role(role: str) -> dict[str, Any]:
        return {"messages": [{"role": role, "content": "Be brief."}, *CHAT["messages"]]}

    assert key(with_role("developer")) == key(with_role("system"))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_model_omitted_served_id_or_alias_share_a_key(endpoint: Endpoint) -> None:
    body: dict[str, Any] = CHAT if endpoint == "chat" else {"prompt": "Once upon"}
    keys = {key({**body, "model": m}, endpoint) for m in ("demo", "/path/demo")}
    assert keys == {key(body, endpoint)}


@pytest.mark.parametrize("mode", list(SamplingMode))
@SOME
@given(
    knobs=st.fixed_dictionaries(
        {},
        optional={
            "top_p": floats(0, 1),
            "top_k": st.integers(0, 1000),
            "min_p": floats(0, 1),
            "seed": st.integers(-(2**63), 2**64 - 1),
        },
    ),
    zero=st.sampled_from([0, 0.0]),
)
def test_greedy_ignores_sampler_knobs(
    mode: SamplingMode, knobs: dict[str, Any], zero: float
) -> None:
    assert key({**CHAT, "temperature": zero, **knobs}, mode=mode) == key(CHAT, mode=mode)


@SOME
@given(
    temperature=st.floats(0, 2, exclude_min=True),
    knobs=st.fixed_dictionaries(
        {},
        optional={
            "top_p": floats(0, 1),
            "seed": st.integers(0, 2**32),
            "top_k": st.integers(0, 50),
        },
    ),
)
def test_force_greedy_rewrites_sampling_to_greedy(
    temperature: float, knobs: dict[str, Any]
) -> None:
    mode = SamplingMode.FORCE_GREEDY
    assert key({**CHAT, "temperature": temperature, **knobs}, mode=mode) == key(CHAT, mode=mode)
    assert key({**CHAT, "temperature": 0.7}, mode=mode) == key(CHAT, mode=SEEDED)


@pytest.mark.parametrize(
    "delivery",
    [
        {"stream": True},
        {"stream": False},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": {"include_usage": False}},
        {"stream_options": {"include_usage": True}},
        {"n": 1},
        {"n": 3},
        {"n": 16, "stream": True},
        {"user": "alice"},
        {"metadata": {"team": "x"}, "store": False, "service_tier": "auto"},
        {"parallel_tool_calls": None, "prompt_cache_key": "k", "safety_identifier": "s"},
        {"prediction": {"type": "content", "content": "x"}, "prompt_cache_retention": "24h"},
        {"prompt_cache_options": {"retention": "24h"}},
        {"tools": [], "tool_choice": None, "response_format": None},
    ],
)
def test_delivery_and_passed_fields_share_a_key(delivery: dict[str, Any]) -> None:
    assert key({**CHAT, **delivery}) == key(CHAT)


def test_responses_pass_the_same_fields_as_chat() -> None:
    from cacheproxy.edge.apis.responses.request import translate

    chat, _ = translate({"input": "Hi", "prompt_cache_retention": "24h", "user": "u",
                         "prompt_cache_options": {"retention": "24h"}, "metadata": {"a": "b"}})
    assert key(chat) == key({"messages": [{"role": "user", "content": "Hi"}]})


@pytest.mark.parametrize(("endpoint", "extra"), [
    ("chat", {"x-unknown": [1, 2, 3]}),
    ("chat", {"repetition_context_size": 40}),  # mlx_lm.server's: it changes the answer
    ("chat", {"xtc_probability": 0.5}),
    ("chat", {"prompt": "an endpoint's field on the other"}),
    ("completions", {"messages": []}),
    ("completions", {"top_logprobs": 2}),
    ("chat", {"store": True}),
])
def test_a_field_the_server_does_not_know_is_refused_not_dropped(
        endpoint: str, extra: dict[str, Any]) -> None:
    body = {**CHAT, **extra} if endpoint == "chat" else {"prompt": "Hi", **extra}
    with pytest.raises(Unsupported) as refused:
        parse(body, endpoint, DEFAULTS, SamplingMode.FORCE_GREEDY)  # type: ignore[arg-type]
    assert refused.value.param == next(iter(extra)) and refused.value.code == \
        "unsupported_parameter"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"max_tokens": 10}, {"max_tokens": 10.0}),
        ({"top_k": 40}, {"top_k": 40.0}),
        ({"temperature": 1}, {"temperature": 1.0}),
        ({"seed": 7}, {"seed": 7.0}),
        ({"presence_penalty": 1}, {"presence_penalty": 1.0}),
        ({"logit_bias": {"5": 1, "7": -1}}, {"logit_bias": {"7": -1.0, "5": 1.0}}),
        ({"logprobs": False, "top_logprobs": 5}, {}),
    ],
)
def test_numbers_are_normalized(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert key({**SAMPLED, **a}) == key({**SAMPLED, **b})


# (c) Any change of a parameter that can change the answer changes the key.


def assert_differ(a: dict[str, Any], b: dict[str, Any], endpoint: Endpoint = "chat") -> None:
    assert key(a, endpoint) != key(b, endpoint)


@SOME
@given(a=texts, b=texts)
def test_message_content_changes_key(a: str, b: str) -> None:
    assume(a != b)
    assert_differ(
        {"messages": [{"role": "user", "content": a}]},
        {"messages": [{"role": "user", "content": b}]},
    )


@SOME
@given(a=st.sampled_from(TEXT_ROLES), b=st.sampled_from(TEXT_ROLES), content=texts)
def test_message_role_changes_key(a: str, b: str, content: str) -> None:
    assume(ROLES[a] != ROLES[b])
    assert_differ(
        {"messages": [{"role": a, "content": content}]},
        {"messages": [{"role": b, "content": content}]},
    )


@SOME
@given(a=messages, b=messages)
def test_conversation_changes_key(a: list[dict[str, str]], b: list[dict[str, str]]) -> None:
    assume(
        [(ROLES[m["role"]], m["content"]) for m in a]
        != [(ROLES[m["role"]], m["content"]) for m in b]
    )
    assert_differ({"messages": a}, {"messages": b})


@SOME
@given(a=st.text(min_size=1), b=st.text(min_size=1))
def test_prompt_changes_key(a: str, b: str) -> None:
    assume(a != b)
    assert_differ({"prompt": a}, {"prompt": b}, "completions")


@SOME
@given(a=st.integers(1, 512), b=st.integers(1, 512))
def test_max_tokens_changes_key(a: int, b: int) -> None:
    assume(a != b)
    assert_differ({**CHAT, "max_tokens": a}, {**CHAT, "max_tokens": b})


@SOME
@given(a=stops, b=stops)
def test_stop_changes_key(a: list[str], b: list[str]) -> None:
    assume(set(a) != set(b))
    assert_differ({**CHAT, "stop": a}, {**CHAT, "stop": b})


PENALTIES = {
    "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2),
    "repetition_penalty": floats(0.01, 10),
}


@pytest.mark.parametrize("field", sorted(PENALTIES))
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@SOME
@given(data=st.data())
def test_penalty_changes_key(field: str, endpoint: Endpoint, data: st.DataObject) -> None:
    a, b = data.draw(PENALTIES[field]), data.draw(PENALTIES[field])
    assume(a != b)
    base: dict[str, Any] = CHAT if endpoint == "chat" else {"prompt": "Once upon"}
    assert_differ({**base, field: a}, {**base, field: b}, endpoint)


@SOME
@given(
    a=st.dictionaries(st.integers(0, 767), floats(-100, 100), max_size=3),
    b=st.dictionaries(st.integers(0, 767), floats(-100, 100), max_size=3),
)
def test_logit_bias_changes_key(a: dict[int, float], b: dict[int, float]) -> None:
    assume(sorted(a.items()) != sorted(b.items()))
    assert_differ(
        {**CHAT, "logit_bias": {str(t): v for t, v in a.items()}},
        {**CHAT, "logit_bias": {str(t): v for t, v in b.items()}},
    )


@pytest.mark.parametrize(
    ("endpoint", "a", "b"),
    [
        ("chat", {}, {"logprobs": True}),
        ("chat", {"logprobs": False}, {"logprobs": True}),
        ("chat", {"logprobs": True}, {"logprobs": True, "top_logprobs": 1}),
        ("chat", {"logprobs": True, "top_logprobs": 1}, {"logprobs": True, "top_logprobs": 2}),
        ("completions", {}, {"logprobs": 0}),
        ("completions", {"logprobs": 0}, {"logprobs": 3}),
    ],
)
def test_logprobs_change_key(endpoint: Endpoint, a: dict[str, Any], b: dict[str, Any]) -> None:
    base: dict[str, Any] = CHAT if endpoint == "chat" else {"prompt": "Once upon"}
    assert_differ({**base, **a}, {**base, **b}, endpoint)


SAMPLER_KNOBS = {
    "temperature": st.floats(0, 2, exclude_min=True),
    "top_p": floats(0, 1),
    "top_k": st.integers(0, 1_000_000),
    "min_p": floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 1),
}


@pytest.mark.parametrize("field", sorted(SAMPLER_KNOBS))
@SOME
@given(data=st.data())
def test_seeded_sampler_knobs_change_key(field: str, data: st.DataObject) -> None:
    a, b = data.draw(SAMPLER_KNOBS[field]), data.draw(SAMPLER_KNOBS[field])
    assume(a != b)
    assert_differ({**SAMPLED, field: a}, {**SAMPLED, field: b})


def test_sampled_differs_from_greedy_in_seeded_mode() -> None:
    assert key(SAMPLED) != key(CHAT)


def test_endpoint_changes_key() -> None:
    text = "Hello there"
    chat = make_key(
        parse({"messages": [{"role": "user", "content": text}]}, "chat", DEFAULTS, SEEDED).request,
        FINGERPRINT.digest,
    )
    completion = make_key(
        parse({"prompt": text}, "completions", DEFAULTS, SEEDED).request, FINGERPRINT.digest
    )
    assert chat != completion


def test_scope_changes_key() -> None:
    request = parse(CHAT, "chat", DEFAULTS, SEEDED).request
    assert make_key(request, FINGERPRINT.digest, scope="a") != make_key(request, FINGERPRINT.digest)


# (d) Any change of the pinned configuration changes the namespace and so the key.


def test_the_name_and_path_of_the_files_do_not_split_the_namespace() -> None:
    # (#21) Content-addressed: two proxies serving the same files share entries.
    moved = dataclasses.replace(FINGERPRINT, model_id="other-name", model_path="/elsewhere")
    assert moved.digest == FINGERPRINT.digest
    assert moved.fields()["model_path"] == "/elsewhere"  # still in the provenance
    served_as = parse({**CHAT, "model": "demo"}, "chat", DEFAULTS, SEEDED).request
    other = dataclasses.replace(served_as, model="other-name")
    assert make_key(other, FINGERPRINT.digest) == make_key(served_as, FINGERPRINT.digest)


def changed_fingerprints() -> list[tuple[str, Fingerprint]]:
    """FINGERPRINT with one field (or one quantization value) changed at a time."""
    out = []
    for f in dataclasses.fields(Fingerprint):
        if f.name in ("quantization", *UNDIGESTED) or not f.init:  # `digest`: derived
            continue
        value = getattr(FINGERPRINT, f.name)
        other = value + 1 if isinstance(value, int) else value + "x"
        out.append((f.name, dataclasses.replace(FINGERPRINT, **{f.name: other})))
    quant = FINGERPRINT.quantization
    for name, value in quant.items():
        other = value + 1 if isinstance(value, int) else f"{value}x"
        out.append(
            (
                f"quantization.{name}",
                dataclasses.replace(FINGERPRINT, quantization={**quant, name: other}),
            )
        )
        out.append(
            (
                f"quantization.{name}=None",
                dataclasses.replace(FINGERPRINT, quantization={**quant, name: None}),
            )
        )
    out.append(
        ("quantization.extra", dataclasses.replace(FINGERPRINT, quantization={**quant, "scale": 1}))
    )
    return out


CHANGED = changed_fingerprints()


def test_every_fingerprint_field_is_covered() -> None:
    names = {name.split(".")[0] for name, _ in CHANGED} | set(UNDIGESTED)
    assert names == {f.name for f in dataclasses.fields(Fingerprint) if f.init}


@pytest.mark.parametrize(("field", "changed"), CHANGED, ids=[n for n, _ in CHANGED])
def test_fingerprint_field_changes_digest_and_key(field: str, changed: Fingerprint) -> None:
    request = parse(CHAT, "chat", DEFAULTS, SEEDED).request
    assert re.fullmatch(r"[0-9a-f]{32}", changed.digest)
    assert changed.digest != FINGERPRINT.digest
    assert make_key(request, changed.digest) != make_key(request, FINGERPRINT.digest)


def test_fingerprint_digest_is_stable() -> None:
    assert dataclasses.replace(FINGERPRINT).digest == FINGERPRINT.digest
    assert len({changed.digest for _, changed in CHANGED}) == len(CHANGED)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"presence_penalty": -0.0}, {"presence_penalty": 0}),
        ({"frequency_penalty": -0.0}, {}),
        ({"min_p": -0.0}, {"min_p": 0.0}),
        ({"logit_bias": {"5": -0.0}}, {"logit_bias": {"5": 0}}),
    ],
)
def test_negative_zero_is_zero(a: dict[str, Any], b: dict[str, Any]) -> None:
    body = orjson.loads(json.dumps({**SAMPLED, **a}))  # JSON "-0.0" decodes to -0.0
    assert key(body) == key({**SAMPLED, **b})
