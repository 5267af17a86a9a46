"""`cacheproxy compare` end to end (in-process: `cli.main.run`): entries a proxy stored on the
demo model, replayed on an identical copy (100 % exact) and on its 4-bit quantization
(`cacheproxy demo-model --quantize 4`), with the report's fields, the HTML report and the
gates."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from cacheproxy.cli.serve import build_app
from cacheproxy.cli.settings import DEMO_MODEL_ID, Settings
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from cacheproxy.service.cassette import open_store
from tests.conftest import Proxy, ProxyFactory
from tests.harness.cli import cacheproxy_blocking
from tests.harness.processes import free_port

run = cacheproxy_blocking  # the CLI as a user runs it, in-process

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANIMAL = {"type": "json_schema", "json_schema": {"name": "animal", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["animal", "food"],
    "properties": {"animal": {"type": "string"}, "food": {"type": "string"}}}}}
NO_THINKING = {"enable_thinking": False}


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 48, **extra}


REQUESTS = [
    # Thinking on: the 4-bit model thinks in other words at token 4 (the stored answer's
    # smallest margin), then gives the same answer for the fox and another for the bear.
    _chat("Tell me everything about the fox.", max_tokens=120),
    _chat("Tell me everything about the bear.", max_tokens=120),
    _chat("Tell me about the cat."),
    _chat("Where does the owl live?"),
    _chat("Tell me about the fox.", response_format=ANIMAL, chat_template_kwargs=NO_THINKING),
    _chat("What does the bear eat?", response_format=ANIMAL, chat_template_kwargs=NO_THINKING),
    _chat("What is the weather in Lima?", tools=[WEATHER], tool_choice="required",
          chat_template_kwargs=NO_THINKING),
    _chat("What is the weather in Oslo?", tools=[WEATHER], tool_choice="required",
          chat_template_kwargs=NO_THINKING),
]
# REQUESTS[4:6] ask for JSON, REQUESTS[6:] force a tool call.


async def _fill(proxy: Proxy) -> list[str]:
    keys = []
    async with aiohttp.ClientSession() as session:
        for body in REQUESTS:
            async with session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["X-Cache"] == "MISS", await resp.text()
                keys.append(resp.headers["X-Cache-Key"])
    return keys


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An identical copy of the demo model and its 4-bit quantization, written by the CLI."""
    where = tmp_path_factory.mktemp("models")
    run("demo-model", "--out", str(where / "copy"), check=True)
    run("demo-model", "--out", str(where / "q4"), "--quantize", "4", check=True)
    return {"copy": where / "copy", "q4": where / "q4"}


async def test_compare_with_a_copy_and_with_the_4_bit_quantization(
    make_proxy: ProxyFactory, tmp_path: Path, models: dict[str, Path]
) -> None:
    store = f"disk://{tmp_path}/store"
    keys = await _fill(await make_proxy(store=store))

    same = run("compare", "--store", store, "--to", str(models["copy"]), "--json",
               "--require-exact", "1.0")
    assert same.returncode == 0, same.stderr
    report = json.loads(same.stdout)
    assert report["checked"] == len(REQUESTS) and sorted(e["key"] for e in report["entries"]) \
        == sorted(keys)
    assert report["exact_match_rate"] == 1.0 and report["parsed_match_rate"] == 1.0
    assert report["fingerprints"]["differ"] == {}  # same files elsewhere: same fingerprint
    assert "token ids" in report["checks"] and report["unchecked"] == []
    # A namespace with no entries is no pass (a gate on the wrong --model must not go green).
    empty = run("compare", "--store", store, "--to", str(models["copy"]), "--namespace",
                "0" * 32, "--require-parsed", "0")
    assert empty.returncode == 1 and "no entries compared" in empty.stderr

    # 4-bit: the report (--json, --report) and the gate (the parsed-match rate is below 1).
    q4 = run("compare", "--store", store, "--to", str(models["q4"]), "--json",
             "--report", str(tmp_path / "report.html"), "--require-parsed", "1.0")
    assert q4.returncode == 1 and "parsed-match rate" in q4.stderr, q4.stderr
    report = json.loads(q4.stdout)
    differ = report["fingerprints"]["differ"]
    assert differ["weights_digest"]["stored"] != differ["weights_digest"]["candidate"]
    assert differ["quantization"]["candidate"]["bits"] == 4
    entries = {e["key"]: e for e in report["entries"]}
    fox, bear = entries[keys[0]], entries[keys[1]]
    # Exact < parsed: the fox's thought changed, its answer did not.
    assert not fox["exact"] and fox["parsed_equal"] and fox["compared_by"] == "text"
    assert not bear["exact"] and not bear["parsed_equal"]
    assert report["exact_match_rate"] < report["parsed_match_rate"] < 1.0
    for e in entries.values():  # every entry: its margin, both texts; json and calls parsed
        assert e["margin"]["smallest"] is not None and e["stored_text"] and e["candidate_text"]
    assert {entries[k]["compared_by"] for k in keys[4:6]} == {"json"}
    assert {entries[k]["compared_by"] for k in keys[6:]} == {"tool_calls"}
    # Every divergence listed with the stored margin, and the stored gap where it diverged.
    divergences = report["divergences"]
    assert {d["key"] for d in divergences["entries"]} == \
        {k for k, e in entries.items() if not e["exact"]}
    for d in divergences["entries"]:
        assert d["margin"] is not None and d["first_divergence"] is not None
        assert (d["gap_at_divergence"] is None) != (d["gap_at_divergence_at_least"] is None)
    fox_divergence = next(d for d in divergences["entries"] if d["key"] == keys[0])
    assert fox_divergence["gap_at_divergence"] == fox["margin"]["smallest"]
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and "parsed-match rate" in page
    assert keys[0].partition("/")[2][:16] in page and "weights_digest" in page

    # The terminal table, with an extractor: the bear's answer (what it eats) survived the
    # rewording too (its row now says parsed "yes"); its JSON answer did not ("honey.! " ->
    # "honey"): JSON is compared parsed, not extracted. 7 of 8 pass a gate at 0.8.
    table = run("compare", "--store", store, "--to", str(models["q4"]), "--extract",
                r"eats (\w+)", "--require-parsed", "0.8")
    assert table.returncode == 0, table.stderr
    assert "exact-match rate" in table.stdout and "parsed-match rate 87.5%" in table.stdout
    assert "differs: weights_digest" in table.stdout
    assert f"{keys[0]}: tokens differ at token 4" in table.stdout
    bear_row = next(line for line in table.stdout.splitlines()
                    if line.startswith(keys[1].partition("/")[2][:12]))
    assert bear_row.split()[1:4] == ["no", "4", "yes"]  # exact, diverges at, parsed


@pytest.mark.parametrize(("flags", "says"), [
    (("--to", "/no/such/model"), "neither an http(s) URL nor a model directory"),
    (("--to", "/tmp", "--require-parsed", "1.5"), "not a rate between 0 and 1"),
    (("--to", "/tmp", "--require-exact", "most"), "is not a number"),
    (("--to", "/tmp", "--extract", "(unclosed"), "neither module:function nor a valid"),
    (("--to", "/tmp", "--extract", "os.path:nothing_here"), "has no function nothing_here"),
    (("--sample", "2"), "say what to compare with: --to CANDIDATE"),
    (("--to", "/tmp", "--rewrite"), "--rewrite rewrites a cassette"),
    (("--cassette", "/no/such.jsonl"), "--cassette /no/such.jsonl: no such file"),
])
def test_bad_compare_flags_are_clear_errors(flags: tuple[str, ...], says: str,
                                            tmp_path: Path) -> None:
    done = run("compare", "--store", f"disk://{tmp_path}/store", *flags)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert not (tmp_path / "store").exists()  # nothing was opened, nothing written


async def test_a_cassette_moves_to_the_4_bit_model_in_one_reviewed_step(
    runner: MlxRunner, tmp_path: Path, models: dict[str, Path]
) -> None:
    """Recorded on fp32, compared and rewritten for the 4-bit model (the bear's answer
    changed: exit 1, named, left out), then replayed on the 4-bit model: HITs."""
    recording = tmp_path / "llm.jsonl"
    bodies = [REQUESTS[0], REQUESTS[1], REQUESTS[4], REQUESTS[6]]  # fox, bear, JSON, tool
    async with served(runner, recording, replay=False) as url:
        keys = await _post_all(url, bodies, "MISS")
    text = recording.read_text()
    # Machine-neutral: no absolute model path, no generation time; the digests stay.
    assert str(BUNDLED_MODEL.parent) not in text and '"generation_ms"' not in text
    assert '"model_path":"demo-model"' in text and '"weights_digest"' in text

    done = run("compare", "--cassette", str(recording), "--to", str(models["q4"]),
               "--rewrite")
    assert done.returncode == 1
    assert f"meaning changed: {keys[1]} (tokens differ)" in done.stderr, done.stderr
    assert "3 entries carried over" in done.stderr
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    q4 = MlxRunner(MlxOptions(model=str(models["q4"]), model_id=DEMO_MODEL_ID))
    await q4.start()
    try:
        digest = q4.fingerprint().digest
        assert len(lines) == 3 and {line["key"].partition("/")[0] for line in lines} == {digest}
        assert all(line["provenance"]["rewritten_from"] in keys for line in lines)
        async with served(q4, recording, replay=True) as url:
            await _post_all(url, [bodies[0], *bodies[2:]], "HIT")
            async with aiohttp.ClientSession() as session, \
                    session.post(url + "/v1/chat/completions", json=bodies[1]) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == \
                    "not_recorded"
        assert q4.generations == 0
    finally:
        await q4.aclose()
    # Rewritten once more on the same model: every entry exact, nothing changed: exit 0.
    again = run("compare", "--cassette", str(recording), "--to", str(models["q4"]),
                "--rewrite", "--require-exact", "1.0")
    assert again.returncode == 0, again.stderr


@asynccontextmanager
async def served(on: MlxRunner, recording: Path, *, replay: bool) -> AsyncIterator[str]:
    """A proxy on a jsonl:// recording (written back when it stops, unless it replays)."""
    settings = Settings(store=f"jsonl://{recording}", model=str(BUNDLED_MODEL), watch=False,
                        replay=replay)
    store = await open_store(settings.store, replay=replay)
    server = TestServer(build_app(settings, runner=on, store=store), host="127.0.0.1",
                        port=free_port())
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()
        await store.aclose()


async def _post_all(url: str, bodies: list[dict[str, Any]], status: str) -> list[str]:
    keys = []
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers["X-Cache"] == status, \
                    await resp.text()
                keys.append(resp.headers["X-Cache-Key"])
    return keys
