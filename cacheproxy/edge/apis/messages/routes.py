"""The Messages API's route besides the answer path: POST /v1/messages/count_tokens.

It answers how many tokens the prompt of a request would be, as the model's tokenizer and
chat template make it (tools, system and thinking switch included): the `input_tokens` a
generation of it reports. Its body is parsed as a message's is (within the schema budget, off
the event loop when it carries schemas). Nothing is generated or stored.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from cacheproxy.edge.answers import read_body
from cacheproxy.edge.apis.messages.request import SCHEMA_FIELDS, count_messages
from cacheproxy.edge.route import json_response
from cacheproxy.edge.state import IDENTITY, OPTIONS, ROUTER
from cacheproxy.errors import Unsupported
from cacheproxy.runners.base import PromptCounter
from cacheproxy.service.memos import BodyParser

_COUNTING = BodyParser(count_messages, SCHEMA_FIELDS)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: `{"input_tokens": N}`."""
    raw = await read_body(request)
    scope = request.get(IDENTITY, "") if request.app[OPTIONS].cache_scope == "per-key" else ""
    proxy = request.app[ROUTER].route(raw, scope)
    runner = proxy.runner
    # As a message's own parse: a schema-laden body is checked off the loop, within budget.
    parsed = await proxy.memos.parser.parse_with(raw, _COUNTING, runner.defaults(),
                                                 proxy.options.sampling, scope)
    if not isinstance(runner, PromptCounter):
        raise Unsupported("this runner cannot count a prompt's tokens without generating")
    # A long prompt takes a while to render and tokenize: off the event loop.
    count = await asyncio.to_thread(runner.prompt_tokens, parsed.request)
    return json_response({"input_tokens": count})
