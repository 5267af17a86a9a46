"""Shared fixtures: the real demo model through mlx_lm.load, real HTTP servers, the openai SDK."""

from __future__ import annotations

import os
import sys

# Bytecode caches: where PYTHONDONTWRITEBYTECODE is set (some sandboxes and CI images set it),
# every process the suite starts (~100: serve, the CLI, mlx_lm.server, the load tests, the
# xdist workers) compiles the project from source again, and pytest rewrites the asserts of
# ~450 modules again in each worker. Writing them (next to the sources, as Python does by
# default; .gitignore has __pycache__) measured: collection 17.6 -> 8.3 s a worker, `serve`
# start-up 2.4 -> 2.0 CPU-s. Done before anything is imported or a worker started.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends import open_backend
from backends.base import Backend, NamespaceStats
from cacheproxy.cli.serve import build_app
from cacheproxy.cli.settings import DEMO_MODEL_ID, Settings
from cacheproxy.edge.state import PROXY
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from tests.harness.processes import Procs, free_port

pytest_plugins = ["tests.harness.redis_fixtures"]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


LOST_GROUP = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # (after pytest-xdist's own, which adds the groups)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` every test marked ``xdist_group`` must carry its group in
    its node id, as pytest-xdist's scheduler reads it there. pytest 9.2 with pytest-xdist 3.8
    drops it without a word (pytest-dev/pytest-xdist#1386; pyproject.toml pins pytest below
    9.2): such a test fails, rather than run beside the others of its group."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        # (xdist's scheduler reads a group after the last "@" past any parameters' "]")
        if mark is not None and item.nodeid.rfind("@") <= item.nodeid.rfind("]"):
            item.stash[LOST_GROUP] = str(mark.args[0] if mark.args else mark.kwargs)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if LOST_GROUP in item.stash:
        pytest.fail(f"--dist loadgroup: pytest-xdist lost this test's xdist_group "
                    f"{item.stash[LOST_GROUP]!r}, so it may run beside the others of its group "
                    "(pytest 9.2 with pytest-xdist 3.8: pytest-xdist#1386; see pyproject.toml)",
                    pytrace=False)


async def eventually(check: Callable[[], bool], within: float = 2.0,
                     every: float = 0.005) -> None:
    """Poll check() every `every` seconds until it holds; AssertionError after `within`."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"condition not reached within {within:g} s"
        await asyncio.sleep(every)


@pytest.fixture
def procs() -> Iterator[Procs]:
    """A group of child processes (tests/harness/processes.py), all stopped at teardown."""
    with Procs() as group:
        yield group


def demo_token(text: str) -> int:
    """The demo model's token id of `text` (one token of its vocabulary)."""
    from tokenizers import Tokenizer

    found = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).token_to_id(text)
    assert found is not None, f"{text!r} is not a token of the demo model"
    return int(found)


@pytest_asyncio.fixture(scope="session")
async def runner() -> AsyncIterator[MlxRunner]:
    """The bundled demo model, loaded once through mlx_lm.load."""
    r = MlxRunner(MlxOptions(model=str(BUNDLED_MODEL), model_id=DEMO_MODEL_ID))
    await r.start()
    yield r
    await r.aclose()


@dataclass
class Proxy:
    """A running proxy: its URL, its app, and an openai client pointed at it."""

    url: str
    app: web.Application
    client: openai.AsyncOpenAI
    store: Backend
    server: TestServer | None = None

    async def stop(self) -> None:
        """Stop serving now (as a replica that shuts down), not at teardown."""
        if self.server is not None:
            await self.server.close()

    async def entries(self) -> int:
        """Entries stored under the serving fingerprint's namespace."""
        if not isinstance(self.store, NamespaceStats):
            raise AssertionError(f"{self.store!r} cannot count a namespace")
        namespace = self.app[PROXY].runner.fingerprint().digest
        return (await self.store.namespace_stats(namespace))[0]

    @property
    def generations(self) -> int:
        """How many generations the runner behind this proxy ran."""
        return self.app[PROXY].runner.generations


ProxyFactory = Callable[..., Awaitable[Proxy]]


@pytest_asyncio.fixture
async def make_proxy(runner: MlxRunner, tmp_path: Path) -> AsyncIterator[ProxyFactory]:
    """Start proxies on real ports (aiohttp TestServer); all are stopped at teardown."""
    servers: list[TestServer] = []
    clients: list[openai.AsyncOpenAI] = []
    stores: list[Backend] = []

    async def start(
        *, store: str = "memory://", the_runner: MlxRunner | None = None,
        own_runners: bool = False, **overrides: object
    ) -> Proxy:
        """own_runners: the app starts (and stops) a runner per model of the settings (several
        with model="ID=PATH,ID=PATH"), not the session's."""
        settings = replace(Settings(store=store, model=str(BUNDLED_MODEL)), **overrides)
        backend = open_backend(settings.store)
        stores.append(backend)
        app = build_app(settings, runner=None if own_runners else the_runner or runner,
                        store=backend)
        server = TestServer(app, host="127.0.0.1", port=free_port())
        await server.start_server()
        servers.append(server)
        url = f"http://127.0.0.1:{server.port}"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        clients.append(client)
        return Proxy(url, app, client, backend, server)

    yield start
    for client in clients:
        await client.close()
    for server in servers:
        await server.close()
    for backend in stores:
        await backend.aclose()


@pytest.fixture
def chat_body() -> dict[str, object]:
    """A chat request the demo model answers in a sentence or two."""
    return {"model": DEMO_MODEL_ID,
            "messages": [{"role": "user", "content": "What does the fox eat?"}]}


Ask = Callable[[str], Awaitable[tuple[str, str]]]


def asker(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Ask:
    """Send `body` to `url` as a model: its X-Cache and fingerprint (the answer names it)."""
    async def ask(model: str) -> tuple[str, str]:
        async with session.post(url, json={**body, "model": model}) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["model"] == model
            return resp.headers["X-Cache"], resp.headers["X-Cache-Fingerprint"]
    return ask


async def miss_then_hit(session: aiohttp.ClientSession, url: str, ask: Ask
                        ) -> dict[str, tuple[str, str]]:
    """Models "demo" and "q" behind the proxy at `url`: each is a MISS then a HIT, under two
    fingerprints, and /v1/models lists both. Each one's first answer."""
    first = {m: await ask(m) for m in ("demo", "q")}
    again = {m: await ask(m) for m in ("demo", "q")}
    assert [c for c, _ in first.values()] == ["MISS", "MISS"]
    assert [c for c, _ in again.values()] == ["HIT", "HIT"]
    assert first["demo"][1] != first["q"][1]
    async with session.get(url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["demo", "q"]
    return first


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs, unmounted at the end (mounting takes root, as .ci/run has: a test
    fails, not skips, without it)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"could not mount a 1 MB tmpfs on {mount}: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
