"""`cacheproxy verify | stats | inspect | purge` end to end (in-process: `cli.main.run`), on
a disk store a server filled."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import aiohttp

from cacheproxy.edge.state import PROXY
from cacheproxy.keys import codec
from cacheproxy.keys.codec import Chunk, Output
from tests.conftest import Proxy, ProxyFactory
from tests.harness.cli import cacheproxy, cacheproxy_blocking, cacheproxy_sync

REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about the cat."}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}],
                              "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "The wolf", "max_tokens": 20, "stop": ["moon"]}),
    ("/v1/completions", {"prompt": "One day the duck", "max_tokens": 30, "logprobs": 1}),
    # A tool call (after a thought: the demo model thinks by default).
    ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the weather in Lima?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]}),
    # Structured output, thinking off (a constrained generation).
    ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me about the fox."}],
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "animal", "strict": True, "schema": {
                "type": "object", "additionalProperties": False, "required": ["name", "food"],
                "properties": {"name": {"type": "string"}, "food": {"type": "string"}}}}}}),
    # The Responses API, thinking on (its reasoning stored with the answer).
    ("/v1/responses", {"input": "What does the owl eat?", "max_output_tokens": 60}),
]


run = cacheproxy_blocking  # the CLI as a user runs it, in-process


async def _fill(proxy: Proxy) -> list[str]:
    keys = []
    async with aiohttp.ClientSession() as session:
        for path, body in REQUESTS:
            async with session.post(proxy.url + path, json=body) as resp:
                assert resp.status == 200 and resp.headers["X-Cache"] == "MISS"
                keys.append(resp.headers["X-Cache-Key"])
    return keys


async def test_verify_reports_100_percent_then_catches_a_tampered_record(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    store = f"disk://{tmp_path}/store"
    proxy = await make_proxy(store=store)
    keys = await _fill(proxy)

    ok = run("verify", "--store", store, "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["checked"] == len(REQUESTS) and report["exact_match_rate"] == 1.0
    assert report["namespace"] == proxy.app[PROXY].runner.fingerprint().digest
    assert report["model"] == proxy.app[PROXY].runner.defaults().model_id  # (#21)

    # Tamper: one stored token changes (the checksum is recomputed, so it decodes fine).
    record = codec.decode(await _get(proxy, keys[2]))
    chunks = list(record.output.chunks)
    third = chunks[1]
    chunks[1] = Chunk(third.text, (third.tokens[0] + 1, *third.tokens[1:]), third.logprobs)
    tampered = Output(tuple(chunks), record.output.finish_reason, record.output.prompt_tokens,
                      record.output.completion_tokens)
    position = len(chunks[0].tokens)
    await proxy.store.set(keys[2], codec.encode(codec.Record(record.request, tampered,
                                                             record.provenance)))
    bad = run("verify", "--store", store, "--json")
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["checked"] == len(REQUESTS) and report["matched"] == len(REQUESTS) - 1
    (mismatch,) = report["mismatches"]
    assert mismatch["key"] == keys[2] and mismatch["first_diverging_token"] == position
    text = run("verify", "--store", store, "--sample", str(len(REQUESTS)))
    rate = f"{100 * (len(REQUESTS) - 1) / len(REQUESTS):.1f}%"
    assert text.returncode == 1 and "MISMATCH" in text.stdout and rate in text.stdout
    assert f"against model {report['model']} (runner " in text.stdout


async def _get(proxy: Proxy, key: str) -> bytes:
    value = await proxy.store.get(key)
    assert value is not None
    return value


async def test_verify_refuses_another_fingerprint_unless_asked(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    store = f"disk://{tmp_path}/store"
    await _fill(await make_proxy(store=store))
    other = "0" * 32
    refused = run("verify", "--store", store, "--namespace", other)
    assert refused.returncode == 2 and "--cross-fingerprint" in refused.stderr
    crossed = run("verify", "--store", store, "--namespace", other, "--cross-fingerprint",
                  "--json")
    assert crossed.returncode == 0 and json.loads(crossed.stdout)["checked"] == 0


async def test_stats_inspect_and_purge_through_the_cli(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    store = f"disk://{tmp_path}/store"
    proxy = await make_proxy(store=store)
    keys = await _fill(proxy)
    digest = keys[0].split("/")[0]

    stats = json.loads(run("stats", "--store", store, "--json").stdout)
    (ns,) = stats["namespaces"]
    assert (ns["namespace"], ns["state"], ns["entries"]) == (digest, "current", len(REQUESTS))
    assert stats["entries"] == len(REQUESTS) and stats["keys"] == len(REQUESTS) + 1  # registry
    readable = run("stats", "--store", store).stdout
    assert "current" in readable and f": {len(REQUESTS)} entries in 1 namespace," in readable

    view = json.loads(run("inspect", keys[1], "--store", store, "--json").stdout)
    assert view["request"]["messages"] == [{"role": "user", "content": "Hello!"}]
    assert view["output"]["logprobs"] and view["output"]["token_ids"]
    provenance = view["provenance"]
    assert provenance["fingerprint"] == digest
    for field in ("created_at", "generation_ms", "proxy_version", "fingerprint_fields"):
        assert provenance[field], field
    assert provenance["fingerprint_fields"]["weights_digest"]
    readable = run("inspect", keys[1], "--store", store).stdout
    assert "fingerprint" in readable and "Hello" in readable
    call = json.loads(run("inspect", keys[4], "--store", store, "--json").stdout)["output"]
    assert call["tool_calls"][0]["name"] == "get_weather" and call["reasoning"]
    assert run("inspect", digest + "/nope", "--store", store).returncode == 1

    assert run("purge", "--key", keys[0], "--store", store).stdout.strip() == "removed 1 entries"
    assert run("purge", "--namespace", digest, "--store", store).stdout.strip() == \
        f"removed {len(REQUESTS) - 1} entries"
    await _fill(proxy)
    refused = run("purge", "--all", "--store", store)  # no terminal to ask, no --yes
    assert refused.returncode == 1 and "--yes" in refused.stderr
    done = run("purge", "--all", "--yes", "--store", store)
    assert done.stdout.strip() == f"removed {len(REQUESTS)} entries"
    assert json.loads(run("stats", "--store", store, "--json").stdout)["entries"] == 0


async def test_purge_superseded_through_the_cli(make_proxy: ProxyFactory, tmp_path: Path) -> None:
    from cacheproxy.service.namespaces import Registry

    store = f"disk://{tmp_path}/store"
    proxy = await make_proxy(store=store)
    await _fill(proxy)
    registry = Registry(proxy.store)
    namespaces = await registry.load()
    (digest,) = namespaces
    # As if the model had changed under a server running with --invalidation retain.
    namespaces[digest] = replace(namespaces[digest], state="superseded")
    await registry.save(namespaces)
    out = run("purge", "--superseded", "--store", store)
    assert out.stdout.strip() == f"removed {len(REQUESTS)} entries"
    assert json.loads(run("stats", "--store", store, "--json").stdout)["namespaces"] == []


def test_a_store_that_fails_is_a_message_not_a_traceback() -> None:
    # (#19) An unreachable store: the store commands say so and exit 2.
    done = cacheproxy_sync("stats", "--store", "redis://127.0.0.1:1/0", check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("cacheproxy: error: ") and "Traceback" not in done.stderr


async def test_stats_on_a_corrupt_registry_says_so_and_counts_the_rest(tmp_path: Path) -> None:
    # (#34) The registry record overwritten with garbage: stats prints what it can count,
    # names the problem in one line and exits 1 (it was a traceback). Control: before the
    # corruption the same store is a clean exit 0.
    from backends import open_backend
    from cacheproxy.service.namespaces import REGISTRY_KEY

    store = f"disk://{tmp_path / 'store'}"
    backend = open_backend(store)
    await backend.set("some/entry", b"x" * 10)
    clean = await cacheproxy("stats", "--store", store, check=False)
    await backend.set(REGISTRY_KEY, b"\xff\x00not a registry")
    await backend.aclose()
    assert clean.returncode == 0 and "error" not in clean.stderr
    done = await cacheproxy("stats", "--store", store, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("cacheproxy: error: the namespace registry is unreadable")
    assert "2 keys with the namespace registry" in done.stdout
    as_json = await cacheproxy("stats", "--store", store, "--json", check=False)
    assert as_json.returncode == 1
    assert "unreadable" in json.loads(as_json.stdout)["registry_error"]


async def test_explain_names_the_field_a_miss_differs_in(make_proxy: ProxyFactory,
                                                          tmp_path: Path) -> None:
    # (#33) `cacheproxy explain` and POST /admin/explain: a stored request is a HIT (exit 0,
    # the control), one that differs only in max_tokens or in a message names that field.
    store = f"disk://{tmp_path}/store"
    proxy = await make_proxy(store=store, admin_token="adm")
    ask = {"messages": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Who sleeps in the barn?"}], "max_tokens": 6}
    other = {"messages": [{"role": "user", "content": "Tell me about the cat."}], "max_tokens": 6}
    async with aiohttp.ClientSession() as session:
        stored = []
        for body in (ask, other):
            async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                assert resp.headers["X-Cache"] == "MISS"
                stored.append(resp.headers["X-Cache-Key"])
        stored_key = stored[0]
        longer = {**ask, "max_tokens": 7}
        async with session.post(proxy.url + "/admin/explain", json=longer,
                                headers={"Authorization": "Bearer adm"}) as resp:
            assert resp.status == 200
            admin = await resp.json()
    assert admin["stored"] is False and admin["complete"] and admin["scanned"] == 2
    assert admin["nearest"][0] == {"key": stored_key, "differences": ["max_tokens"]}
    assert admin["nearest"][1]["differences"][:1] == ["messages: 2 items vs 1"]

    files = {}
    for name, body in {"same": ask, "longer": longer, "owl": {**ask, "messages": [
            ask["messages"][0], {"role": "user", "content": "Who sleeps in the den?"}]}}.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(body))
    same = await cacheproxy("explain", str(files["same"]), "--store", store, "--json",
                            check=False)
    assert same.returncode == 0 and json.loads(same.stdout)["key"] == stored_key
    owl = await cacheproxy("explain", str(files["owl"]), "--store", store, check=False)
    assert owl.returncode == 1, owl.stderr
    assert f"nearest {stored_key}: differs in messages[1].content" in owl.stdout
    refused = await cacheproxy("explain", str(files["same"]), "--store", store, "--api",
                               "completions", check=False)
    assert refused.returncode == 2 and "would refuse" in refused.stderr
