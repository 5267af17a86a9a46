"""Bad input: a clear OpenAI-shaped error, nothing stored, the server keeps answering."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.conftest import ProxyFactory

CHAT = "/v1/chat/completions"
OK_BODY = {"messages": [{"role": "user", "content": "Hello!"}]}
LONG_PROMPT = "The cat eats fish. " * 200  # ~1000 tokens; the demo model's context is 512

BAD = "invalid_request_error"
CASES: list[tuple[str, str, str, bytes, int, str | None, str | None]] = [
    # (name, method, path, body, status, param, code)
    ("malformed json", "POST", CHAT, b'{"messages": [', 400, None, BAD),
    ("invalid utf-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, None, BAD),
    ("not an object", "POST", CHAT, b"[1, 2]", 400, None, BAD),
    ("messages wrong type", "POST", CHAT, b'{"messages": "hi"}', 400, "messages", BAD),
    ("temperature wrong type", "POST", CHAT,
     json.dumps({**OK_BODY, "temperature": "hot"}).encode(), 400, "temperature", BAD),
    ("max_tokens negative", "POST", CHAT,
     json.dumps({**OK_BODY, "max_tokens": -1}).encode(), 400, "max_tokens", BAD),
    ("max_tokens huge", "POST", CHAT,
     json.dumps({**OK_BODY, "max_tokens": 10**30}).encode(), 400, "max_tokens", BAD),
    ("stream wrong type", "POST", CHAT,
     json.dumps({**OK_BODY, "stream": "yes"}).encode(), 400, "stream", BAD),
    ("bad role", "POST", CHAT,
     json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
     "messages[0].role", BAD),
    ("image part", "POST", CHAT, json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400,
     "messages[0].content", "unsupported_parameter"),
    ("tool without a function", "POST", CHAT,
     json.dumps({**OK_BODY, "tools": [{"type": "function"}]}).encode(), 400,
     "tools[0].function", BAD),
    ("unknown model", "POST", CHAT, json.dumps({**OK_BODY, "model": "gpt-9"}).encode(), 404,
     "model", "model_not_found"),
    ("prompt over context", "POST", "/v1/completions",
     json.dumps({"prompt": LONG_PROMPT}).encode(), 400, "prompt", "context_length_exceeded"),
    ("chat over context", "POST", CHAT, json.dumps({"messages": [
        {"role": "user", "content": LONG_PROMPT}]}).encode(), 400, "messages",
     "context_length_exceeded"),
    ("unsupported endpoint", "POST", "/v1/embeddings", b"{}", 404, None, "not_found"),
    ("unknown path", "GET", "/nope", b"", 404, None, "not_found"),
    ("wrong method", "GET", CHAT, b"", 405, None, "method_not_allowed"),
    ("deep nesting", "POST", CHAT, b"[" * 5000 + b"]" * 5000, 400, None, BAD),
]


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "param", "code"), CASES,
                         ids=[c[0] for c in CASES])
async def test_bad_input_gets_openai_error_and_server_survives(
    make_proxy: ProxyFactory, name: str, method: str, path: str, body: bytes, status: int,
    param: str | None, code: str | None,
) -> None:
    proxy = await make_proxy()
    before = await proxy.entries()
    async with aiohttp.ClientSession() as session:
        async with session.request(method, proxy.url + path, data=body,
                                   headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status, await resp.text()
            assert resp.content_type == "application/json"
            error: dict[str, Any] = (await resp.json())["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert error["code"] == code
        assert await proxy.entries() == before  # nothing stored
        async with session.post(proxy.url + CHAT, json=OK_BODY) as resp:
            assert resp.status == 200  # and the server still answers


async def test_body_over_limit_is_413(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(max_body_bytes=4096)
    big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + CHAT, json=big) as resp:
            assert resp.status == 413
            error = (await resp.json())["error"]
        assert error["code"] == "request_too_large" and "4096" in error["message"]
        async with session.post(proxy.url + CHAT, json=OK_BODY) as resp:
            assert resp.status == 200


async def _raw_post(port: int, head: bytes, pieces: list[bytes]) -> tuple[int, bytes]:
    """POST over a raw socket, the body in pieces with pauses between: status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        for piece in pieces:
            await asyncio.sleep(0.05)  # the handler may run before the rest arrives
            writer.write(piece)
        status_line = await asyncio.wait_for(reader.readline(), 30)
        headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return int(status_line.split()[1]), await reader.readexactly(length)
    finally:
        writer.close()


@pytest.mark.parametrize("split", ["whole", "pieces", "chunked", "chunked-whole"])
async def test_a_body_is_read_whole_in_pieces_or_chunked(make_proxy: ProxyFactory,
                                                         split: str) -> None:
    """The handler takes a body that has all arrived without awaiting, and reads the rest:
    both give the same answers and the same 413 over the limit."""
    proxy = await make_proxy(max_body_bytes=4096)
    port = int(proxy.url.rsplit(":", 1)[1])
    for content, status in [("Hello!", 200), ("x" * 5000, 413)]:
        body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
        if split.startswith("chunked"):
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" \
                   b"Transfer-Encoding: chunked\r\n\r\n"
            pieces = [b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:])]
            pieces.append(b"0\r\n\r\n")
        else:
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" \
                   b"Content-Length: %d\r\n\r\n" % len(body)
            pieces = [body] if split == "whole" else [body[:10], body[10:20], body[20:]]
        if split.endswith("whole"):  # all in one write: the body is complete on arrival
            head, pieces = head + b"".join(pieces or [body]), []
        got, answer = await _raw_post(port, head, pieces)
        assert got == status, answer
        if status == 200:
            assert json.loads(answer)["choices"][0]["message"]["content"]
        else:
            assert json.loads(answer)["error"]["code"] == "request_too_large"


async def test_stream_request_with_bad_input_is_a_plain_http_error(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy()
    body = {"prompt": LONG_PROMPT, "stream": True}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/completions", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "context_length_exceeded"


async def test_expect_100_continue_over_the_limit_is_a_413_before_the_body(
        make_proxy: ProxyFactory) -> None:
    """(#19) A client that asks before sending its body is told at once: 413 for a declared
    length over the limit (no `100 Continue`; `Connection: close`, after aiohttp's lingering
    read), `100 Continue` and the answer for one within it."""
    proxy = await make_proxy(max_body_bytes=4096)
    port = int(proxy.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 5)  # without sending a byte
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        rest = await asyncio.wait_for(reader.readexactly(length), 5)
    finally:
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 413"), status_line
    assert b"Connection: close" in head
    assert json.loads(rest)["error"]["code"] == "request_too_large"

    body = json.dumps({"messages": [{"role": "user", "content": "Hello!"}]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == \
            b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert (await asyncio.wait_for(reader.readline(), 30)).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


async def test_an_answer_over_the_budget_is_a_400_and_nothing_is_generated(
        make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(max_answer_tokens=50_000)
    generated = proxy.generations
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 16, "max_tokens": 400,
            "logprobs": True, "top_logprobs": 20}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "response_too_large"
    assert error["param"] == "max_tokens" and "50000" in error["message"]
    assert proxy.generations == generated and await proxy.entries() == 0


async def test_an_unknown_expectation_is_an_openai_shaped_417(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy()
    port = int(proxy.url.rsplit(":", 1)[1])
    status, answer = await _raw_post(
        port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n", [])
    assert status == 417 and json.loads(answer)["error"]["code"] == "expectation_failed"
