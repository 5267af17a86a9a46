"""Clients that never read a large answer (#19): the proxy buffers a piece or two of it per
connection, never the whole answer (back-pressure), keeps no copy of a HIT per client, and
once they hang up nothing of their answers is left for the garbage collector to find.

On asyncio's loop and on uvloop (the one `cacheproxy serve` runs). A real aiohttp server
(the app `serve` builds, on a real port), raw sockets. The server's socket send buffer is
made small (16 KiB, which also turns off its autotuning to 4 MB), so the kernel takes little
of an answer: what is left unsent is what the proxy itself holds.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import tracemalloc
import weakref
from collections.abc import Coroutine
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web

from backends.memory import MemoryBackend
from cacheproxy.cli.serve import build_app
from cacheproxy.cli.settings import DEMO_MODEL_ID, Settings
from cacheproxy.edge.aiohttp_adapter import PIECE, pieces
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from tests.conftest import eventually
from tests.e2e.test_proxy import NO_EOS

CLIENTS = 8
MIB = 1 << 20


def _large(topic: str, **extra: object) -> bytes:
    """A request whose answer is ~2.3 MB (16 choices x 100 tokens x 20 alternatives)."""
    return json.dumps({"model": DEMO_MODEL_ID, "max_tokens": 100, "n": 16, "logprobs": True,
                       "top_logprobs": 20, "logit_bias": NO_EOS,
                       "messages": [{"role": "user", "content": f"Tell me about the {topic}."}],
                       **extra}).encode()


async def _unread(port: int, body: bytes) -> socket.socket:
    """A client that sends its request and never reads (a 4 KiB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _traced() -> int:
    return tracemalloc.get_traced_memory()[0]


class Server:
    """The app `cacheproxy serve` builds, on an aiohttp AppRunner (its connections seen)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.responses: list[weakref.ref[web.StreamResponse]] = []
        app.on_response_prepare.append(self._sent)
        self.runner = web.AppRunner(app, access_log=None)
        self.port = 0

    async def start(self) -> None:
        """Listen on a free port, with a small socket send buffer (see the docstring)."""
        await self.runner.setup()
        listening = socket.create_server(("127.0.0.1", 0))
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # (inherited)
        await web.SockSite(self.runner, listening).start()
        self.port = listening.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def _sent(self, _: web.Request, response: web.StreamResponse) -> None:
        self.responses.append(weakref.ref(response))

    def write_buffers(self) -> list[int]:
        """What each open connection's transport holds unsent."""
        assert self.runner.server is not None
        return [h.transport.get_write_buffer_size() for h in self.runner.server.connections
                if h.transport is not None]

    async def answer_size(self, body: bytes) -> tuple[str, int]:
        """(X-Cache, bytes) of one answer read whole."""
        async with aiohttp.ClientSession() as session, session.post(
                self.url, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["X-Cache"], len(await resp.read())


async def _while_unread(server: Server, body: bytes, answer: int, *, shared: bool) -> None:
    """CLIENTS clients ask for `body` and never read; then they hang up."""
    before = _traced()
    socks = [await _unread(server.port, body) for _ in range(CLIENTS)]
    try:
        # Every answer under way: each transport holds what it may, the rest waits.
        await eventually(lambda: len(server.write_buffers()) == CLIENTS and
                         all(size > 0 for size in server.write_buffers()), within=30)
        await asyncio.sleep(0.1)  # (no further progress: nobody reads)
        held = server.write_buffers()
        assert max(held) <= 4 * PIECE, f"unsent bytes per connection: {held}"
        grown = _traced() - before
        # Shared: the answer is in memory a few times at most (its template, the rendering
        # every follower of a generation is sent from, the generation), not once per client
        # (each client holds a piece or two in its transport's buffer).
        bound = 3 * answer + CLIENTS * 2 * PIECE + MIB if shared else CLIENTS * answer
        assert grown < bound, f"{grown / MIB:.1f} MiB held for {CLIENTS} unread answers"
    finally:
        for sock in socks:
            sock.close()  # unread data: the kernel resets the connection
    await eventually(lambda: not server.write_buffers(), within=10)
    await asyncio.sleep(0.1)  # the handlers see the reset and end
    # Every response is gone (each would hold its answer, or pieces of it), though the
    # collector has not run; what it finds now is what only it would have freed.
    alive = [r for r in server.responses if r() is not None]
    assert not alive, f"{len(alive)} responses of gone clients are still alive"
    server.responses.clear()
    left = _traced()
    gc.collect()
    found = left - _traced()
    assert found < MIB, f"{found / MIB:.1f} MiB of unread answers freed only by the collector"


async def _scenario() -> None:
    model = MlxRunner(MlxOptions(model=str(BUNDLED_MODEL), model_id=DEMO_MODEL_ID))
    await model.start()
    app = build_app(Settings(store="memory://", model=str(BUNDLED_MODEL)), runner=model,
                    store=MemoryBackend())
    server = Server(app)
    await server.start()
    try:
        hit = _large("fox")
        assert (await server.answer_size(hit))[0] == "MISS"
        cache, size = await server.answer_size(hit)
        assert cache == "HIT" and size > 16 * PIECE
        gc.collect()
        gc.disable()
        tracemalloc.start()
        await _while_unread(server, hit, size, shared=True)  # repeated HITs
        streamed = _large("fox", stream=True)
        assert (await server.answer_size(streamed))[0] == "HIT"
        await _while_unread(server, streamed, size, shared=True)  # streamed HITs
        # A generation followed by every client (one MISS, the others COALESCED): whole,
        # then streamed live.
        await _while_unread(server, _large("owl"), size, shared=True)
        await _while_unread(server, _large("cat", stream=True), size, shared=False)
    finally:
        tracemalloc.stop()
        gc.enable()
        await server.runner.cleanup()
        await model.aclose()


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_unread_answers_are_bounded_and_freed_without_the_collector(run: Any) -> None:
    coroutine: Coroutine[Any, Any, None] = _scenario()
    run(coroutine)


def test_pieces_join_small_parts_and_slice_large_ones() -> None:
    parts = [b"a" * 10, b"b" * 10, b"c" * 45, b"d" * 3, b"e" * 7]
    out = [bytes(p) for p in pieces(parts, 16)]
    assert b"".join(out) == b"".join(parts)
    assert [len(p) for p in out] == [20, 16, 16, 13, 10]
    assert list(pieces([], 16)) == [] and [bytes(p) for p in pieces([b"x"], 16)] == [b"x"]


@pytest.mark.parametrize("shape", ["chat", "responses"])
def test_a_large_template_is_sent_as_its_own_parts(shape: str) -> None:
    """Over LARGE_BODY a hit body is rendered as pieces that are the template's own bytes
    (nothing copied per reader), the marked fields filled between them, for a chat
    completion (id then "created") and a Responses object ("created_at", "completed_at")."""
    from cacheproxy.edge.templates import CREATED_MARK, ID_MARK, LARGE_BODY, Template

    text = "x" * LARGE_BODY
    if shape == "chat":
        marked = {"id": ID_MARK, "object": "chat.completion", "created": CREATED_MARK,
                  "choices": [{"message": {"content": text}}]}
        filled = {**marked, "id": "chatcmpl-1", "created": 17}
    else:
        marked = {"id": ID_MARK, "object": "response", "created_at": CREATED_MARK,
                  "output": [{"content": [{"text": text}]}], "completed_at": CREATED_MARK}
        filled = {**marked, "id": "resp_1", "created_at": 17, "completed_at": 17}
    template = Template(json.dumps(marked).replace(": ", ":").encode(), "application/json")
    body = template.render(str(filled["id"]), 17)
    assert isinstance(body, list), "a large body is copied whole per reader"
    assert json.loads(b"".join(body)) == filled
    biggest = max(body, key=len)
    assert len(biggest) > LARGE_BODY and any(biggest is part for part in template._parts)
    small = Template(json.dumps({**marked, **({"choices": []} if shape == "chat" else
                                              {"output": []})}).replace(": ", ":").encode(),
                     "application/json")
    assert isinstance(small.render("r", 1), bytes)


def test_forget_frames_drops_only_the_connection_errors_tracebacks() -> None:
    """A reset raised while handling a generation's error keeps that error's traceback
    (other readers of the generation hold it); the connection errors lose theirs."""
    from cacheproxy.edge.aiohttp_adapter import forget_frames

    shared = ValueError("the generation failed")
    try:
        raise shared
    except ValueError:
        try:
            try:
                raise TimeoutError("timed out")
            except TimeoutError as timeout:
                raise ConnectionResetError("reset") from timeout
        except ConnectionResetError as reset:
            gone = reset
    forget_frames(gone)
    timeout_error = gone.__cause__
    assert gone.__traceback__ is None and timeout_error is not None
    assert timeout_error.__traceback__ is None
    assert timeout_error.__context__ is shared and shared.__traceback__ is not None
