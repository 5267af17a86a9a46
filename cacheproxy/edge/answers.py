"""The POST routes of every API of the table (edge.apis): body -> service -> JSON/SSE.

The service decides everything (status, reason, where the answer comes from); a handler
only reads the body and renders what it gets back in its route's API: a stored HIT or a
flight to relay. The rendered bytes and their memos are the edge's: a repeat of a body whose
HIT was rendered is sent again as it was while the service vouches for that HIT (step 0).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any, assert_never

import orjson
from aiohttp import hdrs, web

from cacheproxy.edge.aiohttp_adapter import Body, Rendered, forget_frames, header_lines
from cacheproxy.edge.apis import APIS, Stream, replay
from cacheproxy.edge.apis.frame import Frame, ResponseIds
from cacheproxy.edge.repeats import Repeat, RepeatKey
from cacheproxy.edge.route import JSON, Handler
from cacheproxy.edge.state import BODIES, CACHE_LOG, IDENTITY, HitPath
from cacheproxy.edge.templates import CREATED_MARK, ID_MARK, FlightBodies, HitTemplates, Template
from cacheproxy.errors import ClientGone, ProxyError, UnreadableBody
from cacheproxy.keys.canonical import Parsed, Route
from cacheproxy.keys.codec import Output
from cacheproxy.observe.logs import SharedFields
from cacheproxy.service.flights import Flight
from cacheproxy.service.proxy import Answer, CachingProxy, Flowing, Stored
from policies.cache_control import response_cache_control
from policies.status import CacheStatus, Reason

SSE = "text/event-stream"


async def _complete(request: web.Request, endpoint: Route, hot: HitPath) -> web.StreamResponse:
    raw = await read_body(request)
    scope = request.get(IDENTITY, "") if hot.options.cache_scope == "per-key" else ""
    memo_key = (endpoint, scope, raw) if hdrs.CACHE_CONTROL not in request.headers else None
    # Step 0: a remembered HIT, without a coroutine when the store holds it in this process.
    if memo_key is not None and (repeat := hot.repeats.get(memo_key)) is not None:
        if repeat.proxy.holds(repeat.hit) or await repeat.proxy.still_stored(repeat.hit):
            return _repeat_hit(repeat, hot.ids)
        hot.repeats.forget(memo_key)
    router = hot.router
    proxy = router.default if router.single else router.route(raw, scope)  # (single: no call)
    answer: Answer = await proxy.answer(endpoint, raw, scope,
                                        request.headers.get(hdrs.CACHE_CONTROL))
    match answer:
        case Stored():
            return _stored_hit(request, answer, proxy, memo_key, hot)
        case Flowing():
            return await _flowing(request, answer, proxy.options.ttl, hot)
        case _:
            assert_never(answer)


async def read_body(request: web.Request) -> bytes:
    """The request body: taken as is when all of it has arrived (a small POST usually has),
    else read within the body limits (edge/bodies.py: 408 past them). Over client_max_size
    is a 413 either way; a body whose Content-Encoding does not decode is a 400; a client
    gone mid-body, a 499."""
    content = request.content
    try:  # (no coroutine of its own: this is on the hit path)
        if content.is_eof():
            raw = content.read_nowait()
        else:
            raw = await request.app[BODIES].read(request)
    except web.RequestPayloadError as exc:
        content.feed_eof()  # (read: aiohttp would read on after the answer, and fail again)
        raise UnreadableBody(f"the request body cannot be read ({exc}): its Content-Encoding "
                             "does not decode") from None
    except ConnectionResetError:
        content.feed_eof()
        raise ClientGone("the client closed the connection in the middle of its body") from None
    if request.client_max_size and len(raw) > request.client_max_size:  # 0: no limit
        raise web.HTTPRequestEntityTooLarge(max_size=request.client_max_size,
                                            actual_size=len(raw))
    return raw


def handler(route: Route, hot: HitPath) -> Handler:
    """The POST handler of an API of the table (edge.apis): _complete with its route and the
    app's hit-path state (a partial, not one more coroutine per hit)."""
    return partial(_complete, endpoint=route, hot=hot)


def _body_of(frame: Frame, output: Output) -> dict[str, Any]:
    return APIS[frame.delivery.api].body(frame, output)


def _stream_of(frame: Frame) -> Stream:
    return APIS[frame.delivery.api].stream(frame)


def _repeat_hit(repeat: Repeat, ids: ResponseIds) -> Rendered:
    """A repeat of a request whose HIT is remembered: the same answer, nothing re-derived."""
    now = time.time()
    age = max(0.0, now - repeat.hit.created_at)
    ttl = repeat.ttl
    if ttl is None:  # Cache-Control does not change with age: it is in the head
        head = b"%bAge: %d\r\n" % (repeat.head, age)
    else:
        control = response_cache_control(stored=True, ttl=ttl, age=age)
        head = b"%bAge: %d\r\nCache-Control: %s\r\n" % (repeat.head, age, control.encode())
    rendered = Rendered(head, repeat.template.render(ids.next(repeat.route), int(now)))
    rendered.cache_log = repeat.log  # (the access line's fields: no request[...] round trip)
    return rendered


def _stored_hit(request: web.Request, hit: Stored, proxy: CachingProxy,
                memo_key: RepeatKey | None, hot: HitPath) -> Rendered:
    """A HIT of the full path: rendered once per record and delivery, remembered for the
    repeats of the same body (`memo_key`, None under Cache-Control)."""
    info = request[CACHE_LOG] = _log_fields(hit.status, hit.reason, hit.key.short,
                                            hit.parsed.request.model)
    output = hit.record.output
    info["tokens"] = output.completion_tokens
    info["runner_ms"] = hit.generation_ms
    headers = _cache_headers(hit.status, hit.reason, hit.key, hit.fingerprint, hit.parsed,
                             stores=True, age=hit.age, ttl=proxy.options.ttl)
    template = _hit_template(hot.templates, hit)
    if memo_key is not None and (held := proxy.hold(hit)) is not None:
        ttl = proxy.options.ttl
        changing = ("Age", "Cache-Control") if ttl is not None else ("Age",)
        fixed = [(k, v) for k, v in headers.items() if k not in changing]
        hot.repeats.remember(memo_key, Repeat(
            proxy=proxy, hit=held, route=memo_key[0], ttl=ttl, template=template,
            head=header_lines([*fixed, ("Content-Type", template.content_type)]),
            log=SharedFields(info)))
    body = template.render(hot.ids.next(hit.parsed.delivery.api), int(time.time()))
    return Rendered(header_lines([*headers.items(), ("Content-Type", template.content_type)]),
                    body)


def _hit_template(templates: HitTemplates, hit: Stored) -> Template:
    """A stored answer rendered once per record and delivery, id and time left open."""
    record, parsed = hit.record, hit.parsed
    frame = _frame(parsed, hit.fingerprint, hit.key, ID_MARK, CREATED_MARK, cached=True)
    if parsed.delivery.stream:
        def draw() -> Template:
            return Template(replay(_stream_of(frame), record.output), SSE)
    else:
        def draw() -> Template:
            return Template(orjson.dumps(_body_of(frame, record.output)), JSON)
    memo_key = (hit.key, parsed.delivery, parsed.request.logprobs)
    return templates.get(memo_key, record, draw)


async def _flowing(request: web.Request, answer: Flowing, ttl: float | None,
                   hot: HitPath) -> web.StreamResponse:
    """An answer through a flight: relayed live (stream) or sent once it ends."""
    info = request[CACHE_LOG] = _log_fields(answer.status, answer.reason, answer.key.short,
                                            answer.parsed.request.model)
    frame = _frame(answer.parsed, answer.fingerprint, answer.key, hot.ids.next(
        answer.parsed.delivery.api), int(time.time()), cached=answer.status is CacheStatus.HIT)
    flight = answer.flight
    if answer.parsed.delivery.stream:
        headers = _cache_headers(answer.status, answer.reason, answer.key, answer.fingerprint,
                                 answer.parsed, stores=answer.stores, age=answer.age, ttl=ttl)
        # (The proxy answered once the flight started: a generation's prefill is known.)
        response = await _stream(request, answer, _prefilled(frame, flight, headers, info),
                                 headers)
    else:
        output = await flight.ended()
        reason = _stored_or_why(answer, info)
        headers = _cache_headers(answer.status, reason, answer.key, answer.fingerprint,
                                 answer.parsed, stores=answer.stores, age=answer.age, ttl=ttl)
        if flight.revalidated:
            headers["X-Cache-Revalidated"] = flight.revalidated
        frame = _prefilled(frame, flight, headers, info)
        headers["Content-Type"] = JSON
        response = Rendered(header_lines(headers.items()),
                            _generated_body(hot.flight_bodies, flight, frame, output))
    if flight.output is not None:
        info["tokens"] = flight.output.completion_tokens
        if answer.status is not CacheStatus.COALESCED and flight.generation_ms is not None:
            info["runner_ms"] = round(flight.generation_ms, 2)
    return response


def _stored_or_why(answer: Flowing, info: dict[str, Any]) -> Reason:
    """The reason an answer shows once its flight ended: why it was not stored when it was
    to be (the store full or read-only), else the plan's; in the access line too."""
    why = answer.flight.not_stored
    if why is None or not answer.stores:
        return answer.reason
    info["reason"] = why.value
    return why


def _generated_body(bodies: FlightBodies, flight: Flight, frame: Frame, output: Output
                    ) -> Body:
    """A whole answer of a flight, rendered once for all its readers of one delivery (the
    id and time filled per reader): a hundred followers of a large answer cost one
    rendering, and share its bytes while they are sent."""
    def draw() -> Template:
        marked = dataclasses.replace(frame, id=ID_MARK, created=CREATED_MARK)
        return Template(orjson.dumps(_body_of(marked, output)), JSON)

    template = bodies.get(flight, (frame.delivery, frame.logprobs, frame.cached), draw)
    return template.render(frame.id, frame.created)


def _prefilled(frame: Frame, flight: Flight, headers: dict[str, str],
               info: dict[str, Any]) -> Frame:
    """A generated answer's prefill in its headers, its usage and (for the one that ran it)
    its access line."""
    prefill = flight.prefill
    if prefill is None or frame.cached:
        return frame
    headers["X-Cache-Prefill"] = prefill.header()
    if info["cache"] != CacheStatus.COALESCED.value:
        info["prefill_reused"], info["prefill_tokens"] = prefill.reused, prefill.total
    return dataclasses.replace(frame, reused=prefill.reused)


def _log_fields(status: CacheStatus, reason: Reason, short_key: str, model: str
                ) -> dict[str, Any]:
    """The cache fields of the access line (the key's request part: entries differ there).
    The enums' own str values: the metrics count them as dict keys, where a plain interned
    str hashes and compares at once."""
    return {"cache": status.value, "reason": reason.value, "key": short_key, "model": model}


def _frame(parsed: Parsed, fingerprint: str, key: str, response_id: str, created: int, *,
           cached: bool) -> Frame:
    return Frame(response_id, created, parsed.request.model, fingerprint, parsed.delivery,
                 parsed.request.logprobs, cached=cached, key=key)


def _cache_headers(status: CacheStatus, reason: Reason, key: str, fingerprint: str,
                   parsed: Parsed, *, stores: bool, age: float, ttl: float | None
                   ) -> dict[str, str]:
    shown = status if reason is Reason.GREEDY else f"{status}; reason={reason}"
    headers = {"X-Cache": shown, "X-Cache-Key": key, "X-Cache-Fingerprint": fingerprint}
    if status is CacheStatus.HIT:
        headers["Age"] = str(int(age))
    headers["Cache-Control"] = response_cache_control(stored=stores, ttl=ttl, age=age)
    if parsed.sampling.rewritten:
        headers["X-Cache-Sampling"] = "rewritten-to-greedy"
    if parsed.schema_guarantee:  # enforced (constrained decoding) or validated (upstream)
        headers["X-Cache-Schema"] = parsed.schema_guarantee
    return headers


async def _stream(request: web.Request, answer: Flowing, frame: Frame,
                  headers: dict[str, str]) -> web.StreamResponse:
    """A live generation (leader or follower): each chunk is sent as it is generated."""
    response = web.StreamResponse(headers={**headers, "Content-Type": SSE})
    await response.prepare(request)
    try:
        await _relay(response, answer, frame, request[CACHE_LOG])
    except OSError as exc:  # reset, broken pipe, timed out
        # The client left: its reading stops here, the shared fill goes on and is stored.
        forget_frames(exc)  # (or a cycle through aiohttp's drain keeps this relay alive)
        request[CACHE_LOG]["client"] = "gone"
    return response


async def _relay(response: web.StreamResponse, answer: Flowing, frame: Frame,
                 info: dict[str, Any]) -> None:
    flight, stream = answer.flight, _stream_of(frame)
    await response.write(stream.start())
    try:
        async for chunk in flight.follow():
            if data := stream.chunk(chunk):
                await response.write(data)
    except ProxyError as exc:
        await response.write(stream.error(exc) + stream.done)
        return
    if flight.output is None:
        raise RuntimeError("stream ended without output")
    tail = stream.end(flight.output)
    if flight.revalidated:  # headers are long gone: say it as an SSE comment
        tail += f": x-cache-revalidated={flight.revalidated}\n\n".encode()
    if (reason := _stored_or_why(answer, info)) is not answer.reason:  # (not stored)
        tail += f": x-cache={answer.status}; reason={reason}\n\n".encode()
    await response.write(tail + stream.done)
    await response.write_eof()
