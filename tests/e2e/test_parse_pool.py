"""Schema checks never block the event loop (#34 item 1): a request whose schemas take
seconds to check is parsed on the parse pool while cached HITs go on being served; a
request over the schema budget is a 400 that names the limit."""

from __future__ import annotations

import asyncio
import http.client
import json
import statistics
import threading
import time
from typing import Any

import aiohttp
import anthropic
import pytest

from cacheproxy.cli.settings import DEMO_MODEL_ID
from cacheproxy.edge.state import PROXY
from cacheproxy.errors import Overloaded, SchemaTooComplex
from cacheproxy.service import parsing
from cacheproxy.service.parsing import ParsePool
from tests.conftest import Proxy, ProxyFactory, eventually

HIT_BODY = {"model": DEMO_MODEL_ID, "max_tokens": 4,
            "messages": [{"role": "user", "content": "What does the fox eat?"}]}
# The probe parsed 10,000 properties (340 KB, ~4-13 s of checks); the fault scenario
# (loadtests/faults.py schema_flood) floods with it. Here a third of it (~1-4 s) is enough
# to show a HIT that waits, and keeps the test cheap.
SCHEMA_PROPERTIES = 3000
ROOMY = {"max_schema_properties": 20_000, "max_schema_bytes": 1 << 20, "schema_timeout": 120.0}


def _wide(properties: int) -> dict[str, Any]:
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}
                                               for i in range(properties)}}
    return {"model": DEMO_MODEL_ID, "max_tokens": 1,
            "messages": [{"role": "user", "content": f"Fill {properties} fields."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "wide", "schema": schema}}}


def _wide_message(properties: int) -> dict[str, Any]:
    """The Messages API's form of `_wide`: its schema in output_config.format."""
    schema = _wide(properties)["response_format"]["json_schema"]["schema"]
    return {"model": DEMO_MODEL_ID, "max_tokens": 1,
            "messages": [{"role": "user", "content": f"Fill {properties} fields."}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}


async def _post(session: aiohttp.ClientSession, proxy: Proxy, body: dict[str, Any],
                path: str = "/v1/chat/completions", **headers: str
                ) -> tuple[int, dict[str, Any]]:
    async with session.post(proxy.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def _time_hits(url: str, done: threading.Event) -> list[tuple[float, float]]:
    """(start, milliseconds) of HITs sent one after another until `done`: from a thread
    of its own, so a blocked event loop shows in the times rather than in the timing."""
    host, port = url.removeprefix("http://").split(":")
    client = http.client.HTTPConnection(host, int(port), timeout=120)
    body, times = json.dumps(HIT_BODY), []
    while not done.is_set():
        started = time.perf_counter()
        client.request("POST", "/v1/chat/completions", body,
                       {"Content-Type": "application/json"})
        response = client.getresponse()
        response.read()
        assert response.status == 200 and response.getheader("X-Cache") == "HIT"
        times.append((started, (time.perf_counter() - started) * 1000))
        time.sleep(0.02)
    client.close()
    return times


async def _hits_while_parsing(proxy: Proxy, path: str = "/v1/chat/completions",
                              body: dict[str, Any] | None = None, status: int = 504
                              ) -> list[float]:
    """Milliseconds of each HIT in flight while a schema of SCHEMA_PROPERTIES properties is
    parsed (asked of `path` only-if-cached: its parse is all the work it makes; `status`
    the answer to it)."""
    async with aiohttp.ClientSession() as session:
        assert (await _post(session, proxy, HIT_BODY))[0] == 200  # stored
        done = threading.Event()
        timer = asyncio.create_task(asyncio.to_thread(_time_hits, proxy.url, done))
        await asyncio.sleep(0.2)
        sent = time.perf_counter()
        got, answer = await _post(session, proxy, body or _wide(SCHEMA_PROPERTIES), path,
                                  **{"Cache-Control": "only-if-cached"})
        parsed = time.perf_counter()
        done.set()
        times = await timer
    assert got == status, answer  # (parsed)
    if status == 504:  # (Anthropic's shape has no code)
        assert answer["error"].get("code", "not_cached") == "not_cached", answer
    assert parsed - sent > 0.5, parsed - sent  # a parse long enough to stall a HIT
    # Those in flight during the parse (from its body's arrival, give or take 50 ms, on).
    return [ms for started, ms in times if started < parsed and started + ms / 1000 > sent + 0.05]


async def test_a_hit_never_waits_for_a_schema_parse(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(**ROOMY)
    times = await _hits_while_parsing(proxy)
    assert len(times) >= 3 and statistics.median(times) < 50, times
    assert proxy.app[PROXY].memos.parser.pool is not None


async def test_a_hit_never_waits_for_a_messages_schema_parse(make_proxy: ProxyFactory) -> None:
    # A Messages body's schema is in output_config.format (not a field chat has): it is
    # parsed on the pool too. (This body, over 16 KB, went there before too: the test below
    # shows a small one does now; the control after it what a parse on the loop does.)
    proxy = await make_proxy(**ROOMY)
    times = await _hits_while_parsing(proxy, "/v1/messages", _wide_message(SCHEMA_PROPERTIES))
    assert len(times) >= 3 and statistics.median(times) < 50, times


async def test_a_small_messages_body_with_a_schema_is_parsed_on_the_pool(
        make_proxy: ProxyFactory) -> None:
    # (Under 16 KB: a larger body goes to the pool whatever it holds.) Each field of a
    # Messages body that carries a schema sends it there; a body without one stays on the loop.
    proxy = await make_proxy()
    pool = proxy.app[PROXY].memos.parser.pool
    assert pool is not None
    with_format = _wide_message(3)
    plain = {k: v for k, v in with_format.items() if k != "output_config"}
    tool = {"name": "f", "input_schema": {"type": "object"}}
    bodies = [(with_format, 1),
              ({**plain, "output_format": with_format["output_config"]["format"]}, 1),
              ({**plain, "tools": [tool]}, 1),
              ({**plain, "output_config": {"effort": "low"}}, 0),  # control: no schema
              (plain, 0)]  # control
    async with aiohttp.ClientSession() as session:
        for body, parses in bodies:
            before = pool.started
            status, answer = await _post(session, proxy, body, "/v1/messages",
                                         **{"Cache-Control": "only-if-cached"})
            assert status == 504, answer  # parsed (and not stored)
            assert pool.started - before == parses, body


async def test_a_hit_never_waits_for_a_count_tokens_schema_parse(
        make_proxy: ProxyFactory) -> None:
    # count_tokens parses its body as a message's is parsed: off the loop (before, on it).
    proxy = await make_proxy(**ROOMY)
    body = {k: v for k, v in _wide_message(SCHEMA_PROPERTIES).items() if k != "max_tokens"}
    times = await _hits_while_parsing(proxy, "/v1/messages/count_tokens", body, 200)
    assert len(times) >= 3 and statistics.median(times) < 50, times


async def test_control_a_parse_on_the_loop_stalls_the_hits(make_proxy: ProxyFactory) -> None:
    # Control: the same timing with the parse forced onto the event loop (the behaviour
    # before the pool): the HIT waits for the whole parse.
    proxy = await make_proxy(parse_off_loop=False, **ROOMY)
    times = await _hits_while_parsing(proxy)
    assert times and max(times) > 400, times


async def test_schemas_over_the_budget_are_a_400_naming_the_limit(
        make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"x": deep}}
    enum = {"type": "object", "properties": {"e": {"enum": list(range(2000))}}}
    cases = [
        (_wide(10_000), "262144 bytes", "response_format"),
        (_wide(6_000), "5000 properties", "response_format"),
        ({**HIT_BODY, "tools": [tool] * 200}, "128 tools", "tools"),
        ({**_wide(1), "response_format": {"type": "json_schema", "json_schema": {
            "name": "deep", "schema": deep}}}, "64 levels", "response_format"),
        ({**_wide(1), "response_format": {"type": "json_schema", "json_schema": {
            "name": "enum", "schema": enum}}}, "1000 enum values", "response_format"),
    ]
    async with aiohttp.ClientSession() as session:
        for body, limit, param in cases:
            started = time.perf_counter()
            status, answer = await _post(session, proxy, body)
            error = answer["error"]
            assert (status, error["code"]) == (400, "schema_too_complex"), answer
            assert limit in error["message"] and (param is None or error["param"] == param)
            assert time.perf_counter() - started < 1.0, limit  # counted, not checked


async def test_messages_schemas_over_the_budget_are_a_400_in_anthropics_shape(
        make_proxy: ProxyFactory) -> None:
    # A Messages body's schemas are its tools' input_schema, output_config.format and the
    # older output_format: each counted, as chat's are, before anything is checked.
    proxy = await make_proxy()
    wide, wider = _wide_message(6_000), _wide_message(10_000)
    tool = {"name": "f", "input_schema": {"type": "object"}}
    cases = [({"output_config": wider["output_config"]}, "262144 bytes"),
             ({"output_config": wide["output_config"]}, "5000 properties"),
             ({"extra_body": {"output_format": wide["output_config"]["format"]}},
              "5000 properties"),
             ({"tools": [{**tool, "name": f"f{i}"} for i in range(200)]}, "128 tools")]
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused",
                                        max_retries=0) as sdk:
        for kw, limit in cases:
            started = time.perf_counter()
            with pytest.raises(anthropic.BadRequestError) as refused:
                await sdk.messages.create(model=DEMO_MODEL_ID, max_tokens=1,
                                          messages=wide["messages"], **kw)
            assert time.perf_counter() - started < 1.0, limit  # counted, not checked
            error = refused.value.body
            assert isinstance(error, dict) and error["type"] == "error", error
            assert error["error"]["type"] == "invalid_request_error", error
            assert "over this server's budget" in error["error"]["message"], error
            assert limit in error["error"]["message"], error
        with pytest.raises(anthropic.BadRequestError) as counted:  # count_tokens: the same
            await sdk.messages.count_tokens(model=DEMO_MODEL_ID, messages=wide["messages"],
                                            output_config=wider["output_config"])
        assert "262144 bytes" in counted.value.message
        # Control: within the budget, the same format is taken and held to.
        answer = await sdk.messages.create(model=DEMO_MODEL_ID, max_tokens=1,
                                           messages=wide["messages"],
                                           output_config=_wide_message(3)["output_config"])
    assert answer.content is not None


async def test_a_schema_check_over_the_time_budget_is_a_400(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(schema_timeout=0.01)
    async with aiohttp.ClientSession() as session:
        status, answer = await _post(session, proxy, _wide(1_000))  # within the counts
    assert (status, answer["error"]["code"]) == (400, "schema_too_complex"), answer
    assert "took over 0.01 s" in answer["error"]["message"]
    async with aiohttp.ClientSession() as session:  # control: a small schema in time
        status, _ = await _post(session, await make_proxy(), _wide(3))
    assert status == 200


async def test_keys_take_turns_on_the_parse_worker() -> None:
    """(The pool alone: jobs that record their order.) A key flooding schemas delays another
    key's check by the one running, not by its whole queue; past its own bound it gets a
    503 while the other key still gets in."""
    pool = ParsePool(max_outstanding=8, max_per_scope=3, timeout=30.0)
    release, order = threading.Event(), []

    def job(name: str, wait: bool = False) -> str:
        if wait:
            release.wait()
        order.append(name)
        return name

    try:
        flood = [asyncio.create_task(pool.run(lambda n=n: job(n, n == "a1"), "flooder"))
                 for n in ("a1", "a2", "a3")]
        await asyncio.sleep(0.1)
        with pytest.raises(Overloaded):  # its fourth: over its own bound
            await pool.run(lambda: job("a4"), "flooder")
        other = asyncio.create_task(pool.run(lambda: job("b1"), "other"))
        await asyncio.sleep(0.1)
        release.set()
        assert await other == "b1" and await asyncio.gather(*flood) == ["a1", "a2", "a3"]
        assert order == ["a1", "b1", "a2", "a3"], order  # b1 right after the running one
        # Control: alone, one key's jobs run in the order they came.
        order.clear()
        assert await asyncio.gather(*(pool.run(lambda n=n: job(n), "flooder")
                                      for n in ("c1", "c2", "c3"))) == ["c1", "c2", "c3"]
        assert order == ["c1", "c2", "c3"]
    finally:
        release.set()
        pool.close()


async def test_the_time_budget_counts_the_checks_cpu_not_its_wait_for_a_core() -> None:
    """(The pool alone.) A check that waits is not charged for the wait: a sleeping job
    stands in for a check starved of a core or of the GIL on a loaded server (the starvation
    itself cannot be produced on demand; it once made a few-millisecond check of an honest
    schema wait over 5 s and be refused). A check that spends its budget of CPU is cut (it
    would spin for 5 s); one that neither ends nor spends is cut at WALL_FACTOR budgets."""
    pool = ParsePool(timeout=0.2)
    stop, release = threading.Event(), threading.Event()

    def spin() -> str:
        end = time.thread_time() + 5.0
        while time.thread_time() < end and not stop.is_set():
            pass
        return "spun"

    try:
        assert await pool.run(lambda: time.sleep(0.5) or "waited") == "waited"
        with pytest.raises(SchemaTooComplex, match="took over 0.2 s of CPU"):
            await pool.run(spin)  # (cut at 0.2 s of CPU: its 5 s would have ended it)
        stop.set()
        await eventually(lambda: pool.outstanding == 0, within=5)
        pool.timeout = 0.05  # the backstop: 10 budgets of wall time, 0.5 s
        started = time.monotonic()
        with pytest.raises(SchemaTooComplex):
            await pool.run(lambda: release.wait(5))
        assert 0.45 < time.monotonic() - started < 2.0
    finally:
        stop.set()
        release.set()
        pool.close()


async def test_without_a_clock_of_a_threads_cpu_the_budget_is_wall_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(macOS has no `pthread_getcpuclockid`: the fallback, set here by hand.) The budget is
    then the wall clock's, as it was: a waiting check is cut at it."""
    monkeypatch.setattr(parsing, "CPU_CLOCK", None)
    pool = ParsePool(timeout=0.2)
    release = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(SchemaTooComplex):
            await pool.run(lambda: release.wait(5))
        assert time.monotonic() - started < 2.0
    finally:
        release.set()
        pool.close()
