"""HTTP handlers: parse -> service -> render. OpenAI shapes, cache headers, SSE."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from cacheproxy import canonical, render
from cacheproxy.canonical import Endpoint, Parsed
from cacheproxy.codec import Output
from cacheproxy.errors import InvalidRequest, ProxyError
from cacheproxy.service import Answer
from cacheproxy.state import CACHE_LOG, INVALIDATOR, PROXY, SETTINGS, STARTED


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    """A JSON response serialized with orjson."""
    return web.Response(body=orjson.dumps(data), status=status, headers=headers,
                        content_type="application/json")


async def read_json(request: web.Request) -> object:
    """The decoded body; 400 on anything that is not JSON (413 is raised by aiohttp)."""
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _complete(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _complete(request, "completions")


async def _complete(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    proxy, settings = request.app[PROXY], request.app[SETTINGS]
    body = await read_json(request)
    parsed = canonical.parse(body, endpoint, proxy.runner.defaults(), settings.sampling)
    answer = await proxy.answer(parsed)
    if answer.flight is not None:
        await answer.flight.started()  # errors before the first token are real HTTP errors
        if answer.flight.from_store:
            answer = Answer("HIT", answer.reason, answer.key, answer.fingerprint,
                            flight=answer.flight)
    request[CACHE_LOG] = {"cache": answer.status, "reason": answer.reason, "key": answer.key[33:45]}
    headers = _cache_headers(answer, parsed)
    frame = render.new_frame(endpoint, parsed.delivery, parsed.request.model, answer.fingerprint,
                             logprobs=parsed.request.logprobs, cached=answer.status == "HIT")
    if parsed.delivery.stream:
        return await _stream(request, answer, frame, headers)
    output = await _whole(answer)
    return json_response(render.body(frame, output), headers=headers)


def _cache_headers(answer: Answer, parsed: Parsed) -> dict[str, str]:
    status = answer.status
    if answer.reason != "greedy":
        status += f"; reason={answer.reason}"
    headers = {
        "X-Cache": status,
        "X-Cache-Key": answer.key,
        "X-Cache-Fingerprint": answer.fingerprint,
    }
    if answer.status == "HIT":
        headers["Age"] = str(int(answer.age))
    if parsed.sampling.rewritten:
        headers["X-Cache-Sampling"] = "rewritten-to-greedy"
    return headers


async def _whole(answer: Answer) -> Output:
    if answer.record is not None:
        return answer.record.output
    flight = answer.flight
    if flight is None:
        raise RuntimeError("an answer without a record or a flight")
    async for _ in flight.follow():
        pass
    if flight.output is None:
        raise RuntimeError("flight ended without output")
    return flight.output


async def _stream(request: web.Request, answer: Answer, frame: render.Frame,
                  headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={
        **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in render.stream_start(frame):
        await _send(response, event)
    offset = 0
    try:
        if answer.record is not None:
            output: Output | None = answer.record.output
            for chunk in answer.record.output.chunks:
                offset = await _send_chunk(response, frame, chunk, offset)
        else:
            flight = answer.flight
            if flight is None:
                raise RuntimeError("an answer without a record or a flight")
            async for chunk in flight.follow():
                offset = await _send_chunk(response, frame, chunk, offset)
            output = flight.output
    except ProxyError as exc:
        await _send(response, exc.body())
        await response.write(b"data: [DONE]\n\n")
        return response
    if output is None:
        raise RuntimeError("stream ended without output")
    for event in render.stream_end(frame, output):
        await _send(response, event)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _send_chunk(response: web.StreamResponse, frame: render.Frame, chunk: Any,
                      offset: int) -> int:
    event = render.stream_chunk(frame, chunk, offset)
    if event is not None:
        await _send(response, event)
    return offset + len(chunk.text)


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(event) + b"\n\n")


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
        "time": time.time(),
    })

