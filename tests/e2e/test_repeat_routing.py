"""A repeat HIT decodes no JSON, whichever model it asks for: a one-model server never looks
at a body to route it, and with several models a body already routed once is routed again
from its bytes (#35)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from cacheproxy.edge.state import MODELS, ROUTER
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from tests.conftest import ProxyFactory

CHAT = "/v1/chat/completions"
TWO_MODELS = f"demo={BUNDLED_MODEL},twin={BUNDLED_MODEL}"


def _decodes(app: web.Application) -> int:
    """Request bodies JSON-decoded so far: to route them, and to parse them (every proxy)."""
    proxies = {served.proxy for served in app[MODELS].values()}
    return app[ROUTER].decodes + sum(proxy.memos.parser.decodes for proxy in proxies)


async def _ask(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with session.post(url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["model"] == body["model"]
        return resp.headers["X-Cache"]


@pytest.mark.parametrize("names", [("cacheproxy-demo",), ("demo", "twin")],
                         ids=["one model", "two models"])
async def test_a_repeat_hit_decodes_no_json(make_proxy: ProxyFactory,
                                            names: tuple[str, ...]) -> None:
    if len(names) == 1:
        proxy = await make_proxy()
    else:
        proxy = await make_proxy(own_runners=True, model=TWO_MODELS)
    bodies = [{"model": name, "messages": [{"role": "user", "content": "Who is the owl?"}],
               "max_tokens": 8} for name in names]
    async with aiohttp.ClientSession() as session:
        for body in bodies:  # stored, then a HIT of the full path, remembered
            await _ask(session, proxy.url, body)
            assert await _ask(session, proxy.url, body) == "HIT"
        before = _decodes(proxy.app)
        for _ in range(3):
            for body in bodies:
                assert await _ask(session, proxy.url, body) == "HIT"
        assert _decodes(proxy.app) == before
        # (The count counts: a body never seen is decoded.)
        await _ask(session, proxy.url, {**bodies[-1], "max_tokens": 9})
        assert _decodes(proxy.app) > before
