"""Typed application state keys."""

from __future__ import annotations

from aiohttp import web

from cacheproxy.invalidation import Invalidator
from cacheproxy.service import CachingProxy
from cacheproxy.settings import Settings

SETTINGS = web.AppKey("settings", Settings)
PROXY = web.AppKey("proxy", CachingProxy)
INVALIDATOR = web.AppKey("invalidator", Invalidator)
STARTED = web.AppKey("started", float)
CACHE_LOG = web.RequestKey("cache_log", dict)
