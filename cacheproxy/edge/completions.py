"""HTTP handlers: parse -> service -> render. OpenAI shapes, cache headers, SSE."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from cacheproxy.edge import render
from cacheproxy.edge.prerendered import Rendered, header_lines
from cacheproxy.edge.state import (
    CACHE_LOG,
    HOT,
    IDENTITY,
    INVALIDATOR,
    PROXY,
    SETTINGS,
    STARTED,
    Hot,
)
from cacheproxy.errors import ProxyError
from cacheproxy.keys.canonical import Endpoint, Parsed
from cacheproxy.keys.codec import Chunk, Output
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.observe.logs import SharedFields
from cacheproxy.service.flights import Flight
from cacheproxy.service.memos import CREATED_MARK, ID_MARK, Repeat, Repeats, Template
from cacheproxy.service.proxy import Answer
from policies.cache_control import parse_cache_control, response_cache_control

JSON = "application/json"
SSE = "text/event-stream"


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    """A JSON response serialized with orjson."""
    return web.Response(body=orjson.dumps(data), status=status, headers=headers,
                        content_type=JSON)


async def _complete(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    app = request.app
    proxy, hot, settings = app[PROXY], app[HOT], app[SETTINGS]
    raw = await _body(request)
    scope = request.get(IDENTITY, "") if settings.cache_scope == "per-key" else ""
    control = request.headers.get("Cache-Control")
    if control is None and (repeat := hot.repeats.get(endpoint, scope, raw)) is not None:
        if proxy.still_held(repeat.key, repeat.data, repeat.fingerprint) or \
                await proxy.still_stored(repeat.key, repeat.data, repeat.fingerprint):
            return _repeat_hit(request, repeat, hot, settings.ttl)
        hot.repeats.forget(endpoint, scope, raw)
    parsed = hot.parser.parse(raw, endpoint, proxy.runner.defaults(), settings.sampling)
    answer = await proxy.answer(parsed, directives=parse_cache_control(control), scope=scope)
    if answer.flight is not None:
        await answer.flight.started()  # errors before the first token are real HTTP errors
        if answer.flight.from_store:  # stored meanwhile, here or by another replica
            status = "COALESCED" if answer.flight.remote else "HIT"
            age = max(0.0, time.time() - (answer.flight.created_at or time.time()))
            answer = Answer(status, answer.reason, answer.key, answer.fingerprint,
                            flight=answer.flight, age=age)
    info = request[CACHE_LOG] = {"cache": answer.status, "reason": answer.reason,
                                 "key": answer.key[33:45]}
    headers = _cache_headers(answer, parsed, settings.ttl)
    if answer.record is not None:
        info["tokens"] = answer.record.output.completion_tokens
        ms = answer.record.provenance.get("generation_ms")
        info["runner_ms"] = float(ms) if isinstance(ms, int | float) else 0.0
        template = _hit_template(hot, answer, parsed)
        if control is None:
            _remember(hot.repeats, (endpoint, scope, raw), answer, template, headers, info,
                      proxy.runner.fingerprint())
        body = template.fill(hot.ids.next(endpoint), int(time.time()))
        return web.Response(body=body, headers=headers, content_type=template.content_type)
    frame = _frame(parsed, answer, hot.ids.next(endpoint), int(time.time()))
    if parsed.delivery.stream:
        response = await _stream(request, answer, frame, headers)
    else:
        output = await _whole(answer)
        if answer.flight is not None and answer.flight.revalidated:
            headers["X-Cache-Revalidated"] = answer.flight.revalidated
        response = json_response(render.body(frame, output), headers=headers)
    _generation_info(info, answer)
    return response


async def _body(request: web.Request) -> bytes:
    """The request body: taken as is when all of it has arrived (a small POST usually has),
    else read as aiohttp reads it. Over client_max_size is a 413 either way."""
    content = request.content
    if not content.is_eof():
        return await request.read()
    raw = content.read_nowait()
    if request.client_max_size and len(raw) > request.client_max_size:  # 0: no limit
        raise web.HTTPRequestEntityTooLarge(max_size=request.client_max_size,
                                            actual_size=len(raw))
    return raw


# The POST routes: _complete with its endpoint (a partial, not one more coroutine per hit).
chat_completions = partial(_complete, endpoint="chat")
chat_completions.__doc__ = "POST /v1/chat/completions."
completions = partial(_complete, endpoint="completions")
completions.__doc__ = "POST /v1/completions."


def _repeat_hit(request: web.Request, repeat: Repeat, hot: Hot, ttl: float | None
                ) -> Rendered:
    """A repeat of a request whose HIT is remembered: the same answer, nothing re-derived."""
    request[CACHE_LOG] = repeat.log
    now = time.time()
    age = max(0.0, now - repeat.created_at)
    control = response_cache_control(stored=True, ttl=ttl, age=age)
    head = b"%bAge: %d\r\nCache-Control: %s\r\n" % (repeat.head, age, control.encode())
    body = repeat.template.fill(hot.ids.next(repeat.endpoint), int(now))
    return Rendered(head, body)


def _remember(repeats: Repeats, memo_key: tuple[Endpoint, str, bytes], answer: Answer,
              template: Template, headers: dict[str, str], info: dict[str, Any],
              serving: Fingerprint) -> None:
    """Keep what this HIT needed, so that repeats of the same bytes go straight to the
    store check (only while the fingerprint it was keyed under is the one serving)."""
    if answer.record is None or answer.stored is None or serving.digest != answer.fingerprint:
        return
    endpoint, scope, raw = memo_key
    fixed = [(k, v) for k, v in headers.items() if k not in ("Age", "Cache-Control")]
    repeats.remember(endpoint, scope, raw, Repeat(
        fingerprint=serving, key=answer.key, data=answer.stored, endpoint=endpoint,
        created_at=float(answer.record.provenance.get("created_at", 0.0)),
        template=template, head=header_lines([*fixed, ("Content-Type", template.content_type)]),
        log=SharedFields(info)))


def _generation_info(info: dict[str, Any], answer: Answer) -> None:
    flight = answer.flight
    if flight is not None and flight.output is not None:
        info["tokens"] = flight.output.completion_tokens
        if answer.status != "COALESCED" and flight.generation_ms is not None:
            info["runner_ms"] = round(flight.generation_ms, 2)


def _frame(parsed: Parsed, answer: Answer, response_id: str, created: int) -> render.Frame:
    return render.Frame(response_id, created, parsed.request.model, answer.fingerprint,
                        parsed.request.endpoint, parsed.delivery, parsed.request.logprobs,
                        cached=answer.status == "HIT")


def _hit_template(hot: Hot, answer: Answer, parsed: Parsed) -> Template:
    """A stored answer rendered once per record and delivery, id and time left open."""
    record = answer.record
    if record is None:
        raise RuntimeError("a hit without a record")
    frame = _frame(parsed, answer, ID_MARK, CREATED_MARK)
    if parsed.delivery.stream:
        def draw() -> Template:
            return Template(render.whole_stream(frame, record.output), SSE)
    else:
        def draw() -> Template:
            return Template(orjson.dumps(render.body(frame, record.output)), JSON)
    return hot.templates.get((answer.key, parsed.delivery, parsed.request.logprobs), record,
                             draw)


def _cache_headers(answer: Answer, parsed: Parsed, ttl: float | None) -> dict[str, str]:
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
    headers["Cache-Control"] = response_cache_control(stored=answer.stores, ttl=ttl,
                                                      age=answer.age)
    if parsed.sampling.rewritten:
        headers["X-Cache-Sampling"] = "rewritten-to-greedy"
    return headers


async def _whole(answer: Answer) -> Output:
    flight = answer.flight
    if flight is None:
        raise RuntimeError("an answer without a record or a flight")
    return await flight.ended()


async def _stream(request: web.Request, answer: Answer, frame: render.Frame,
                  headers: dict[str, str]) -> web.StreamResponse:
    """A live generation (leader or follower): each chunk is sent as it is generated."""
    flight = answer.flight
    if flight is None:
        raise RuntimeError("an answer without a record or a flight")
    response = web.StreamResponse(headers={**headers, "Content-Type": SSE})
    await response.prepare(request)
    try:
        await _relay(response, flight, frame)
    except ConnectionError:
        # The client left: its reading stops here, the shared fill goes on and is stored.
        request[CACHE_LOG]["client"] = "gone"
    return response


async def _relay(response: web.StreamResponse, flight: Flight, frame: render.Frame) -> None:
    await response.write(render.sse(render.stream_start(frame)))
    offset = 0
    try:
        async for chunk in flight.follow():
            offset = await _send_chunk(response, frame, chunk, offset)
    except ProxyError as exc:
        await response.write(render.sse([exc.body()]) + render.DONE)
        return
    if flight.output is None:
        raise RuntimeError("stream ended without output")
    tail = render.sse(render.stream_end(frame, flight.output))
    if flight.revalidated:  # headers are long gone: say it as an SSE comment
        tail += f": x-cache-revalidated={flight.revalidated}\n\n".encode()
    await response.write(tail + render.DONE)
    await response.write_eof()


async def _send_chunk(response: web.StreamResponse, frame: render.Frame, chunk: Chunk,
                      offset: int) -> int:
    event = render.stream_chunk(frame, chunk, offset)
    if event is not None:
        await response.write(render.sse([event]))
    return offset + len(chunk.text)


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
