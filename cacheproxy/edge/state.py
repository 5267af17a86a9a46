"""Typed application state keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from cacheproxy.cli.settings import Settings
from cacheproxy.service.invalidation import Invalidator
from cacheproxy.service.memos import HitTemplates, ParseMemo, Repeats, ResponseIds
from cacheproxy.service.proxy import CachingProxy


@dataclass(frozen=True, slots=True)
class Hot:
    """The hot path's memos, owned by one app."""

    parser: ParseMemo = field(default_factory=ParseMemo)
    templates: HitTemplates = field(default_factory=HitTemplates)
    ids: ResponseIds = field(default_factory=ResponseIds)
    repeats: Repeats = field(default_factory=Repeats)


SETTINGS = web.AppKey("settings", Settings)
PROXY = web.AppKey("proxy", CachingProxy)
INVALIDATOR = web.AppKey("invalidator", Invalidator)
STARTED = web.AppKey("started", float)
CACHE_LOG = web.RequestKey("cache_log", dict)
HOT = web.AppKey("hot", Hot)
IDENTITY = web.RequestKey("identity", str)
