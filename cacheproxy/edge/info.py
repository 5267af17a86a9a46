"""GET /v1/models and GET /health."""

from __future__ import annotations

import time

from aiohttp import web

from cacheproxy.edge.route import json_response
from cacheproxy.edge.state import (
    CONNECTIONS,
    INVALIDATOR,
    MODELS,
    PROXY,
    STARTED,
    STATUS_READER,
    Served,
)


def served(app: web.Application) -> list[Served]:
    """Every served model once, the default first."""
    out: list[Served] = []
    for model in app[MODELS].values():
        if all(model.proxy is not known.proxy for known in out):
            out.append(model)
    return out


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: every served model."""
    created = int(request.app[STARTED])
    return json_response({"object": "list", "data": [
        {"id": model.proxy.runner.defaults().model_id, "object": "model", "created": created,
         "owned_by": "cacheproxy"} for model in served(request.app)]})


def model_states(app: web.Application) -> list[dict[str, object]]:
    """Per served model: its id, fingerprint, lane, generations and invalidation counters."""
    return [{"id": m.proxy.runner.defaults().model_id,
             "fingerprint": m.proxy.runner.fingerprint().digest,
             "lane": m.proxy.runner.lane_state(), "generations": m.proxy.runner.generations,
             "counters": {**m.proxy.counters, **m.invalidator.counters}}
            for m in served(app)]


async def health(request: web.Request) -> web.Response:
    """GET /health: up, and the fingerprint answers are keyed under; for a reader of the
    traffic figures (`--status-access`) also the lanes, counters and connections. Nothing
    else: a figure that moves with other clients' requests (saved prefix chunks, fills,
    generations) would let one tenant watch another's."""
    proxy = request.app[PROXY]
    head = {"status": "ok", "model": proxy.runner.defaults().model_id,
            "fingerprint": proxy.runner.fingerprint().digest}
    if not request.app[STATUS_READER](request):
        return json_response({**head, "time": time.time()})
    return json_response({
        **head,
        "lane": proxy.runner.lane_state(),
        "fills_in_progress": len(proxy.flights),
        "counters": {**proxy.counters, **request.app[INVALIDATOR].counters},
        "connections": request.app.get(CONNECTIONS, {}),
        "models": model_states(request.app),
        "time": time.time(),
    })
