"""Typed application state: the edge's options and the parts the app's lifecycle starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from cacheproxy.edge.apis.frame import ResponseIds
from cacheproxy.edge.bodies import BodyReads
from cacheproxy.edge.repeats import Repeats
from cacheproxy.edge.routing import Router
from cacheproxy.edge.templates import FlightBodies, HitTemplates
from cacheproxy.observe.metrics import Metrics
from cacheproxy.service.invalidation import Invalidator
from cacheproxy.service.proxy import CachingProxy


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeOptions:
    """What the HTTP edge itself needs to know (the face derives it from the settings)."""

    max_body_bytes: int = 1 << 20
    cache_scope: str = "shared"  # "shared" | "per-key": the caller's key identity joins keys
    api_keys: tuple[str, ...] = ()
    admin_token: str = ""  # empty: no admin API (404)
    status_access: str = "public"  # who reads /metrics, /status.json: admin | api-key | public
    max_in_flight: int = 1024
    body_timeout: float = 10.0  # seconds for a request body to arrive (408 past it)
    body_min_rate: float = 1024.0  # bytes a second a body arriving must keep up (408 below)
    max_body_reads: int = 64  # bodies arriving at once (the oldest is cut past it)
    store_label: str = ""  # the store URL without credentials, for operators
    # The browser guard (edge/origin.py) of a proxy bound to loopback without keys ("": off).
    bound_host: str = ""
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()


@dataclass(slots=True)
class HitPath:
    """What the answer routes read on every request, held by the routes themselves (on a
    repeat HIT each `request.app[KEY]` cost two property calls and a method call), and the
    memos of rendered bytes."""

    options: EdgeOptions
    ids: ResponseIds
    router: Router[CachingProxy] = field(init=False)  # set when the app starts (ROUTER too)
    repeats: Repeats = field(default_factory=Repeats)  # whole HIT responses, by body
    templates: HitTemplates = field(default_factory=HitTemplates)  # stored answers rendered
    flight_bodies: FlightBodies = field(default_factory=FlightBodies)  # generated ones


@dataclass(frozen=True, slots=True)
class Served:
    """One served model: its proxy (runner, memos, flights) and its invalidator."""

    proxy: CachingProxy
    invalidator: Invalidator


OPTIONS = web.AppKey("options", EdgeOptions)
PROXY = web.AppKey("proxy", CachingProxy)
INVALIDATOR = web.AppKey("invalidator", Invalidator)
STARTED = web.AppKey("started", float)
METRICS = web.AppKey("metrics", Metrics)
IDS = web.AppKey("ids", ResponseIds)
BODIES = web.AppKey("bodies", BodyReads)  # the request bodies arriving now (edge/bodies.py)
CACHE_LOG = web.RequestKey("cache_log", dict)
IDENTITY = web.RequestKey("identity", str)
# Every served model by id and alias (several with --model ID=PATH ...; PROXY is the first).
MODELS = web.AppKey("models", dict[str, Served])
ROUTER = web.AppKey("router", Router[CachingProxy])  # MODELS as the POST routes use them
CONNECTIONS = web.AppKey("connections", dict[str, int])  # the connection guard's counters (serve)
# Whether a request may read the traffic figures (`--status-access`): /health shows its
# lane, counters and connections only to such a reader (it is open: load balancers poll it).
STATUS_READER: web.AppKey[Callable[[web.Request], bool]] = web.AppKey("status_reader")
