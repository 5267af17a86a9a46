"""Repeats of a request whose HIT is remembered: same answer as the full path, and never
served once the store, the request's directives or the serving model say otherwise."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from backends import TieredBackend
from cacheproxy.edge.state import PROXY
from cacheproxy.edge.templates import CREATED_MARK, ID_MARK, Template
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import Parsed
from tests.conftest import Proxy, ProxyFactory

CHAT = "/v1/chat/completions"
BODY = {"model": "cacheproxy-demo", "messages": [{"role": "user", "content": "Who is the owl?"}],
        "max_tokens": 12}
SAME_EVERY_TIME = ("X-Cache", "X-Cache-Key", "X-Cache-Fingerprint", "Cache-Control",
                   "Content-Type", "Age")


async def _post(proxy: Proxy, body: dict[str, Any] = BODY, headers: dict[str, str] | None = None
                ) -> tuple[CIMultiDict[str], bytes]:
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + CHAT, json=body, headers=headers or {}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers.copy(), await resp.read()


def _without_id_and_time(raw: bytes) -> Any:
    if raw.startswith(b"data: "):
        events = [json.loads(line[6:]) for line in raw.split(b"\n\n")
                  if line.startswith(b"data: {")]
    else:
        events = [json.loads(raw)]
    for event in events:
        event.pop("id"), event.pop("created")
    return events


def _never_parse(proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, the full path fails loudly: answers must come from the repeat path."""

    def refuse(*_: object) -> Parsed:
        raise AssertionError("the request was parsed again")

    monkeypatch.setattr(proxy.app[PROXY].memos.parser, "parse", refuse)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_repeat_answers_as_the_full_path_did(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    proxy = await make_proxy()
    body = {**BODY, "stream": stream}
    miss, _ = await _post(proxy, body)
    full, full_body = await _post(proxy, body)  # the full path's HIT, remembered
    _never_parse(proxy, monkeypatch)
    again, again_body = await _post(proxy, body)
    assert (miss["X-Cache"], full["X-Cache"], again["X-Cache"]) == ("MISS", "HIT", "HIT")
    assert {k: again[k] for k in SAME_EVERY_TIME} == {k: full[k] for k in SAME_EVERY_TIME}
    assert again["X-Request-Id"] != full["X-Request-Id"]
    named, _ = await _post(proxy, body, headers={"X-Request-Id": "client-chose-this"})
    assert (named["X-Cache"], named["X-Request-Id"]) == ("HIT", "client-chose-this")
    tabbed, _ = await _post(proxy, body, headers={"X-Request-Id": "not\tprintable"})
    assert tabbed["X-Cache"] == "HIT" and tabbed["X-Request-Id"] not in ("", "not\tprintable")
    assert _without_id_and_time(again_body) == _without_id_and_time(full_body)
    assert json.loads(again_body.split(b"\n")[0].removeprefix(b"data: "))["id"] != \
        json.loads(full_body.split(b"\n")[0].removeprefix(b"data: "))["id"]
    assert proxy.app[PROXY].runner.generations >= 1


def _count_gets(proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real_get = proxy.store.get

    async def counted(key: str) -> bytes | None:
        calls.append(key)
        return await real_get(key)

    monkeypatch.setattr(proxy.store, "get", counted)
    return calls


async def test_a_repeat_held_in_memory_takes_no_store_call(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await make_proxy()
    await _post(proxy)
    await _post(proxy)
    _never_parse(proxy, monkeypatch)
    gets = _count_gets(proxy, monkeypatch)
    again, _ = await _post(proxy)
    assert again["X-Cache"] == "HIT" and gets == []  # peeked, not awaited


async def test_a_repeat_not_in_l1_reads_l2(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    proxy = await make_proxy(store=f"tiered+disk://{tmp_path / 'l2'}")
    await _post(proxy)
    hit, _ = await _post(proxy)
    _never_parse(proxy, monkeypatch)
    assert isinstance(proxy.store, TieredBackend)
    assert await proxy.store.l1.delete(hit["X-Cache-Key"])  # as when its l1_ttl ran out
    gets = _count_gets(proxy, monkeypatch)
    again, _ = await _post(proxy)
    assert again["X-Cache"] == "HIT" and gets == [hit["X-Cache-Key"]]
    held, _ = await _post(proxy)  # read back into L1: peeked again
    assert held["X-Cache"] == "HIT" and gets == [hit["X-Cache-Key"]]


async def test_a_deleted_entry_is_generated_again(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    await _post(proxy)
    hit, _ = await _post(proxy)
    before = proxy.generations
    assert await proxy.store.delete(hit["X-Cache-Key"])
    again, _ = await _post(proxy)
    assert again["X-Cache"] == "MISS" and proxy.generations == before + 1


async def test_a_replaced_record_is_what_repeats_get(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    await _post(proxy)
    hit, _ = await _post(proxy)
    key = hit["X-Cache-Key"]
    stored = await proxy.store.get(key)
    assert stored is not None
    record = codec.decode(stored)
    chunk = codec.Chunk(text="A replaced answer.", tokens=(1, 2, 3))
    output = dataclasses.replace(record.output, chunks=(chunk,), completion_tokens=3)
    await proxy.store.set(key, codec.encode(dataclasses.replace(record, output=output)))
    again, raw = await _post(proxy)
    assert again["X-Cache"] == "HIT"
    assert json.loads(raw)["choices"][0]["message"]["content"] == "A replaced answer."


async def test_request_directives_take_the_full_path(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    await _post(proxy)
    await _post(proxy)
    before = proxy.generations
    fresh, _ = await _post(proxy, headers={"Cache-Control": "max-age=0"})
    assert fresh["X-Cache"] == "MISS; reason=max-age" and proxy.generations == before + 1
    only, _ = await _post(proxy, headers={"Cache-Control": "only-if-cached"})
    assert only["X-Cache"] == "HIT"


async def test_an_open_breaker_is_not_bypassed_by_a_repeat(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(store_retry=60)
    await _post(proxy)
    await _post(proxy)
    proxy.app[PROXY].breaker.failed()  # as after a store failure on another request
    again, _ = await _post(proxy)
    assert again["X-Cache"] == "BYPASS; reason=store-unavailable"


SHAPES = {  # event field orders: the join fills the first, two replaces the others
    "id-then-created": ([("id", "created", "content")] * 2, True),
    "created-then-id": ([("created", "id", "content")] * 2, False),
    "other-field-between": ([("id", "created", "content"), ("id", "model", "created")], False),
    "created-alone": ([("id", "created", "content"), ("created", "content")], False),
    "no-marks": ([("content",), ("content",)], False),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_a_template_fills_every_id_and_time_and_keeps_percent_signs(shape: str) -> None:
    marks = {"id": ID_MARK, "created": CREATED_MARK, "model": "m"}
    orders, joined = SHAPES[shape]

    def event(order: tuple[str, ...], content: str) -> bytes:
        fields = {name: marks.get(name, content) for name in order}
        return b"data: " + json.dumps(fields, separators=(",", ":")).encode() + b"\n\n"

    body = event(orders[0], "100%(i)s sure, 5%") + event(orders[1], "%d%%")
    template = Template(body, "text/event-stream")
    assert (template._between is not None) is joined
    filled = template.fill("chatcmpl-x1", 1796010318)
    expected = body.replace(f'"{ID_MARK}"'.encode(), b'"chatcmpl-x1"').replace(
        str(CREATED_MARK).encode(), b"1796010318")
    assert filled == expected
    assert copy.copy(template).fill("chatcmpl-x1", 1796010318) == expected  # every field set
    events = [json.loads(line[6:]) for line in filled.split(b"\n\n") if line]
    assert [e.get("content") for e in events][:1] == ["100%(i)s sure, 5%"]
