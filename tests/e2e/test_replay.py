"""Record and replay: a recorded session exported, imported elsewhere and replayed byte for
byte; what was not recorded fails loudly and names itself; a tampered line is refused with its
number; a jsonl:// recording lives in a file (the README's pytest set-up:
tests/system/test_readme_replay.py)."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from backends import open_backend
from cacheproxy.cli.serve import build_app
from cacheproxy.cli.settings import Settings
from cacheproxy.keys import transcript
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.key import make_key
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.service.cassette import Cassette, open_store
from cacheproxy.service.namespaces import cache_entries
from tests.conftest import ProxyFactory, free_port
from tests.e2e.test_tool_calling import WEATHER
from tests.harness.cli import cacheproxy

CHAT, TEXT, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
ANIMALS = ("fox", "owl", "cat", "wolf", "duck")
SESSION: list[tuple[str, dict[str, Any]]] = [
    *[(CHAT, {"messages": [{"role": "user", "content": f"What does the {a} eat?"}],
              "stream": i % 2 == 1}) for i, a in enumerate(ANIMALS)],
    *[(TEXT, {"prompt": f"The {a}", "max_tokens": 16, "stream": i % 2 == 0})
      for i, a in enumerate(ANIMALS)],
    *[(CHAT, {"messages": [{"role": "user", "content": f"What is the weather in {c}?"}],
              "tools": [WEATHER], "stream": i % 2 == 0})
      for i, c in enumerate(("Paris", "Tokyo", "Lima"))],
    (CHAT, {"messages": [{"role": "user", "content": "Tell me about the bear."}],
            "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 24}),
    (CHAT, {"messages": [{"role": "user", "content": "Hello!"}], "logprobs": True,
            "top_logprobs": 2, "stream": True}),
    (RESPONSES, {"input": "Where does the frog live?"}),
    (RESPONSES, {"input": "Where does the horse live?", "stream": True}),
    (CHAT, {"messages": [{"role": "user", "content": "What color is the mouse?"}],
            "response_format": {"type": "json_object"}}),
    (CHAT, {"messages": [{"role": "user", "content": "Tell me a story about the rabbit."}],
            "max_tokens": 30, "n": 2}),
    (TEXT, {"prompt": "Once upon a time", "max_tokens": 12, "logprobs": 2}),
]


def _comparable(raw: bytes) -> Any:
    """A response with what may differ between two answers of one entry set aside: the
    response id, its time, and the prompt tokens a HIT reports as cached."""
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in (
                "id", "created", "created_at", "completed_at", "cached_tokens")}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value
    if raw.startswith((b"data: ", b"event: ")):
        events = [line.split(b": ", 1)[1] for line in raw.split(b"\n")
                  if line.startswith(b"data: {")]
        return [clean(json.loads(e)) for e in events]
    return clean(json.loads(raw))


async def _replay(url: str, session: aiohttp.ClientSession) -> list[tuple[str, Any]]:
    out = []
    for path, body in SESSION:
        async with session.post(url + path, json={"model": "cacheproxy-demo", **body}) as resp:
            assert resp.status == 200, await resp.text()
            out.append((resp.headers["X-Cache"], _comparable(await resp.read())))
    return out


async def _replaying_proxy(store: str) -> TestServer:
    settings = Settings(store=store, model=str(BUNDLED_MODEL), replay=True, watch=False)
    server = TestServer(build_app(settings), host="127.0.0.1", port=free_port())
    await server.start_server()
    return server


async def test_a_recorded_session_replays_byte_for_byte_from_another_store(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    recorded_store = f"disk://{tmp_path}/recorded"
    proxy = await make_proxy(store=recorded_store)
    async with aiohttp.ClientSession() as session:
        recording = await _replay(proxy.url, session)
    assert [status for status, _ in recording] == ["MISS"] * len(SESSION)
    await proxy.store.aclose()  # the disk store's file is whole once closed
    export = await cacheproxy("export", "--store", recorded_store, "--out",
                              str(tmp_path / "rec.jsonl"))
    assert f"exported {len(SESSION)} entries" in export.stderr
    lines = (tmp_path / "rec.jsonl").read_text().splitlines()
    assert len(lines) == len(SESSION) and lines == sorted(lines)  # one an entry, by key
    # Readable: the model's answer is there as text (SESSION[0] is a whole chat answer).
    answer = recording[0][1]["choices"][0]["message"]["content"]
    assert answer and answer in [json.loads(line)["output"]["text"] for line in lines]
    replayed_store = f"disk://{tmp_path}/elsewhere"
    await cacheproxy("import", str(tmp_path / "rec.jsonl"), "--store", replayed_store)
    server = await _replaying_proxy(replayed_store)
    try:
        async with aiohttp.ClientSession() as session:
            replayed = await _replay(f"http://127.0.0.1:{server.port}", session)
            assert [status for status, _ in replayed] == ["HIT"] * len(SESSION)
            assert [body for _, body in replayed] == [body for _, body in recording]
            body = {"model": "cacheproxy-demo",
                    "messages": [{"role": "user", "content": "What does the dragon eat at night?"}]}
            async with session.post(f"http://127.0.0.1:{server.port}{CHAT}", json=body) as resp:
                assert resp.status == 404
                assert resp.headers["X-Cache"] == "MISS; reason=not-recorded"
                error = (await resp.json())["error"]
    finally:
        await server.close()
    assert error["code"] == "not_recorded" and "chat" in error["message"]
    assert "What does the dragon eat at night?" in error["message"]
    assert error["request"]["messages"][0]["content"] == "What does the dragon eat at night?"


async def _recorded(make_proxy: ProxyFactory, tmp_path: Path, requests: int) -> str:
    """A disk store holding the first requests of SESSION (closed: its file is whole)."""
    store = f"disk://{tmp_path}/recorded"
    proxy = await make_proxy(store=store)
    async with aiohttp.ClientSession() as session:
        for path, body in SESSION[:requests]:
            async with session.post(proxy.url + path, json=body) as resp:
                await resp.read()
    await proxy.store.aclose()
    return store


async def test_a_tampered_line_and_another_fingerprint_are_refused(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    store = await _recorded(make_proxy, tmp_path, 3)
    good = tmp_path / "rec.jsonl"
    await cacheproxy("export", "--store", store, "--out", str(good))
    lines = good.read_text().splitlines()
    second = json.loads(lines[1])
    second["output"]["chunks"][0]["tokens"][0] += 1  # one token changed
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join([lines[0], json.dumps(second), lines[2]]) + "\n")
    refused = await cacheproxy("import", str(tampered), "--store", f"disk://{tmp_path}/b",
                               check=False)
    assert refused.returncode == 2 and "line 2" in refused.stderr, refused.stderr
    assert "checksum" in refused.stderr
    assert await _count(f"disk://{tmp_path}/b") == 0  # nothing of the file was written
    text = json.loads(lines[0])
    text["output"]["text"] = "The fox eats nothing."  # the readable text, not the chunks
    (tmp_path / "text.jsonl").write_text(json.dumps(text) + "\n")
    refused = await cacheproxy("import", str(tmp_path / "text.jsonl"), "--store",
                               f"disk://{tmp_path}/c", check=False)
    assert refused.returncode == 2 and "line 1" in refused.stderr
    # Another fingerprint: refused, unless keyed anew (and then verify audits it).
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_bytes(_foreign(lines[0]))
    other = await cacheproxy("import", str(foreign), "--store", f"disk://{tmp_path}/d",
                             check=False)
    assert other.returncode == 2 and "--as-current" in other.stderr


async def test_as_current_keys_entries_anew_and_verify_audits_them(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    store = await _recorded(make_proxy, tmp_path, 2)
    lines = (await cacheproxy("export", "--store", store)).stdout.splitlines()
    (tmp_path / "foreign.jsonl").write_bytes(b"".join(_foreign(line) for line in lines))
    target = f"disk://{tmp_path}/current"
    await cacheproxy("import", str(tmp_path / "foreign.jsonl"), "--store", target, "--as-current")
    report = json.loads((await cacheproxy("verify", "--store", target, "--json")).stdout)
    assert report["checked"] == 2 and report["exact_match_rate"] == 1.0
    key = await _first_key(target)
    view = json.loads((await cacheproxy("inspect", key, "--store", target, "--json")).stdout)
    assert view["provenance"]["imported_from"] == "0" * 32


def _foreign(line: str) -> bytes:
    """The line as if another engine had produced it: another namespace, a valid line."""
    _, record = transcript.from_line(line.encode())
    other = "0" * 32
    provenance = {**record.provenance, "fingerprint": other}
    key = make_key(CanonicalRequest.from_wire(record.request), other)
    return transcript.to_line(key, replace(record, provenance=provenance))


async def _first_key(store: str) -> str:
    out = (await cacheproxy("export", "--store", store)).stdout.splitlines()
    return str(json.loads(out[0])["key"])


async def _count(url: str) -> int:
    store = open_backend(url)
    try:
        return (await cache_entries(store, (await store.stats()).entries))  # type: ignore[attr-defined]
    finally:
        await store.aclose()


async def test_a_jsonl_recording_is_written_back_and_replays(tmp_path: Path) -> None:
    recording = tmp_path / "llm.jsonl"
    settings = Settings(store=f"jsonl://{recording}", model=str(BUNDLED_MODEL), watch=False)
    for replay, expected in ((False, "MISS"), (True, "HIT")):
        server = TestServer(build_app(replace(settings, replay=replay)), host="127.0.0.1",
                            port=free_port())
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session, session.post(
                    f"http://127.0.0.1:{server.port}{CHAT}", json=SESSION[0][1]) as resp:
                assert resp.headers["X-Cache"] == expected
        finally:
            await server.close()
        assert recording.read_text().count("\n") == 1  # written at shutdown; read back
    # Flushes at once (two POST /admin/flush, or one racing shutdown): one whole file.
    written = recording.read_bytes()
    store = await open_store(f"jsonl://{recording}")
    assert isinstance(store, Cassette)
    assert await asyncio.gather(*(store.flush() for _ in range(4))) == [1] * 4
    await store.aclose()
    assert recording.read_bytes() == written and os.listdir(tmp_path) == ["llm.jsonl"]
    assert os.stat(recording).st_mode & 0o777 == 0o644
    line = json.loads(recording.read_text())
    line["output"]["chunks"][0]["tokens"][0] += 1  # one token changed
    recording.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        await open_store(f"jsonl://{recording}")
