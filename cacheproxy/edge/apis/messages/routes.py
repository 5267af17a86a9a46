"""The Messages API's route besides the answer path: POST /v1/messages/count_tokens.

It answers how many tokens the prompt of a request would be, as the model's tokenizer and
chat template make it (tools, system and thinking switch included): the `input_tokens` a
generation of it reports. Nothing is generated or stored.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from cacheproxy.edge.answers import read_body
from cacheproxy.edge.apis.messages.request import parse_messages
from cacheproxy.edge.route import json_response
from cacheproxy.edge.state import IDENTITY, OPTIONS, ROUTER
from cacheproxy.errors import Unsupported
from cacheproxy.keys.fields import decode_body
from cacheproxy.runners.base import PromptCounter


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: `{"input_tokens": N}`."""
    raw = await read_body(request)
    scope = request.get(IDENTITY, "") if request.app[OPTIONS].cache_scope == "per-key" else ""
    proxy = request.app[ROUTER].route(raw, scope)
    runner = proxy.runner
    parsed = parse_messages(decode_body(raw), runner.defaults(), proxy.options.sampling,
                            max_tokens_cap=proxy.options.max_tokens_cap, counting=True)
    if not isinstance(runner, PromptCounter):
        raise Unsupported("this runner cannot count a prompt's tokens without generating")
    # A long prompt takes a while to render and tokenize: off the event loop.
    count = await asyncio.to_thread(runner.prompt_tokens, parsed.request)
    return json_response({"input_tokens": count})
