"""Grammars bounded by what they cost: a schema whose grammar blows up (a regex bomb, a
self-reference, a huge const) is a 400 `schema_too_complex` naming the field, with no parser
state in the message, and leaves nothing in the compiled-grammar cache or the process's RSS;
the cache is bounded in bytes as well as in count."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from llguidance import LLMatcher, LLParserLimits

from cacheproxy.cli.settings import DEMO_MODEL_ID
from cacheproxy.errors import SchemaTooComplex
from cacheproxy.keys.grammar import COMPACT
from cacheproxy.runners.grammars import GrammarBudget, Grammars, mask_of
from cacheproxy.runners.mlx import MlxRunner
from tests.conftest import ProxyFactory


def resident_mb() -> float:
    """This process's resident set (the proxy runs in it), in MB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def bomb(n: int) -> dict[str, Any]:
    """A 170-byte schema whose regex unrolls to ~2 million states (each n a new grammar)."""
    return {"type": "string", "pattern": f"^((a{{200}}){{100}}){{{n}}}$"}


def body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"model": DEMO_MODEL_ID, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say a word."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "Bomb", "schema": schema}}}


async def post(session: aiohttp.ClientSession, url: str, schema: dict[str, Any]
               ) -> tuple[int, dict[str, Any]]:
    async with session.post(url + "/v1/chat/completions", json=body(schema)) as resp:
        return resp.status, await resp.json()


def assert_too_complex(status: int, answer: dict[str, Any]) -> None:
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == "schema_too_complex", error
    assert error["param"] == "response_format", error
    # llguidance's verbose errors dump parser state and grammar: none of it reaches a client.
    assert "<" not in error["message"] and "\n" not in error["message"], error["message"]


def test_the_regex_bomb_does_blow_up_llguidance(runner: MlxRunner) -> None:
    """Control: the bomb is hostile to the engine itself (its second mask fails), so the
    400s below are this proxy catching it, not a schema the engine takes in its stride."""
    grammars = runner.grammars
    text = LLMatcher.grammar_from_json_schema(bomb(100), defaults=COMPACT)
    matcher = LLMatcher(grammars._llguidance_tokenizer(), text, log_level=0,
                        limits=LLParserLimits(verbose_errors=True))
    matcher.consume_tokens(matcher.compute_ff_tokens())
    with pytest.raises(SchemaTooComplex):
        mask_of(matcher, grammars.vocab_size, "x")
    assert "too many expressions" in matcher.get_error()


async def test_regex_bombs_are_400s_cached_nowhere_and_rss_stays_bounded(
        make_proxy: ProxyFactory, runner: MlxRunner) -> None:
    proxy = await make_proxy()
    grammars = runner.grammars
    async with aiohttp.ClientSession() as session:
        warm = {"type": "object", "properties": {"w": {"type": "integer"}}, "required": ["w"]}
        status, answer = await post(session, proxy.url, warm)  # first grammar use, warm
        assert status == 200, answer
        held, count, before = grammars.held_bytes, len(grammars), resident_mb()
        for n in range(100, 120):
            assert_too_complex(*await post(session, proxy.url, bomb(n)))
        grown = resident_mb() - before
        print(f"RSS {before:.0f} MB -> +{grown:.0f} MB after 20 regex bombs")
        assert grown < 200, f"RSS grew {grown:.0f} MB"
        assert (len(grammars), grammars.held_bytes) == (count, held)  # nothing cached
        assert await proxy.entries() == 1  # nor stored
        # Control: a schema that compiles is cached, so the assertion above can fail.
        other = {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"]}
        status, answer = await post(session, proxy.url, other)
        assert status == 200, answer
        assert len(grammars) == count + 1


async def test_a_streamed_bomb_is_a_400_too(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/chat/completions", json={**body(bomb(150)), "stream": True}) as r:
        assert_too_complex(r.status, await r.json())


async def test_a_strict_tool_with_a_bomb_is_a_400_naming_tools(make_proxy: ProxyFactory
                                                                ) -> None:
    proxy = await make_proxy()
    parameters = {"type": "object", "properties": {"a": bomb(151)}, "required": ["a"],
                  "additionalProperties": False}
    request = {"model": DEMO_MODEL_ID, "max_tokens": 8,
               "messages": [{"role": "user", "content": "Call f."}],
               "tools": [{"type": "function", "function": {
                   "name": "f", "strict": True, "parameters": parameters}}]}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/chat/completions", json=request) as resp:
        status, answer = resp.status, await resp.json()
    assert status == 400, answer
    assert (answer["error"]["code"], answer["error"]["param"]) == ("schema_too_complex",
                                                                   "tools"), answer


async def test_self_reference_and_a_huge_const_are_clear_400s(make_proxy: ProxyFactory
                                                               ) -> None:
    proxy = await make_proxy(max_body_bytes=4 << 20)
    async with aiohttp.ClientSession() as session:
        for schema in ({"$ref": "#"}, {"const": "x" * 900_000}):
            status, answer = await post(session, proxy.url, schema)
            assert status == 400, answer
            assert answer["error"]["code"] in ("schema_too_complex", "unsupported_parameter")
            assert "response_format" in answer["error"]["param"], answer
            assert "<" not in answer["error"]["message"], answer


def test_the_cache_is_bounded_in_bytes_as_well_as_in_count(runner: MlxRunner) -> None:
    budget = GrammarBudget(max_grammars=100, max_bytes=60_000)
    grammars = Grammars(runner.tokenizer, runner.vocab_size, budget=budget)
    for i in range(12):  # ~10 KB each at least (their text): the bytes bound evicts
        schema = {"enum": [f"value-{i}-{j}-" + "y" * 80 for j in range(100)]}
        grammars.matcher(LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT), "f")
        assert grammars.held_bytes <= budget.max_bytes
    assert 0 < len(grammars) < 12
    # Control: the same grammars under a count bound alone are all kept.
    roomy = Grammars(runner.tokenizer, runner.vocab_size,
                     budget=GrammarBudget(max_grammars=100, max_bytes=1 << 40))
    for i in range(12):
        schema = {"enum": [f"value-{i}-{j}-" + "y" * 80 for j in range(100)]}
        roomy.matcher(LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT), "f")
    assert len(roomy) == 12
