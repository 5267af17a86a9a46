"""GET /v1/models and GET /health."""

from __future__ import annotations

import time

from aiohttp import web

from cacheproxy.edge.route import json_response
from cacheproxy.edge.state import CONNECTIONS, INVALIDATOR, PROXY, STARTED


async def models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    proxy = request.app[PROXY]
    model = proxy.runner.defaults().model_id
    created = int(request.app[STARTED])
    return json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": "cacheproxy"}]})


async def health(request: web.Request) -> web.Response:
    """GET /health: the runner's lane and the fingerprint answers are keyed under."""
    proxy = request.app[PROXY]
    return json_response({
        "status": "ok",
        "model": proxy.runner.defaults().model_id,
        "fingerprint": proxy.runner.fingerprint().digest,
        "lane": proxy.runner.lane_state(),
        "fills_in_progress": len(proxy.flights),
        "counters": {**proxy.counters, **request.app[INVALIDATOR].counters},
        "connections": request.app.get(CONNECTIONS, {}),
        "time": time.time(),
    })
