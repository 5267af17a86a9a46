"""Browser guard of a proxy bound to loopback without API keys: no cross-site requests, no
DNS rebinding.

Such a proxy trusts whoever reaches it; a web page the user visits reaches it too, through the
browser. Three checks refuse what a browser sends on another site's behalf, with a 403 in the
API's error shape:
- an `Origin` that is neither the proxy's own loopback origin nor an allowed one (a `fetch`
  or form from any other site; `Origin: null` included);
- a POST whose Content-Type a browser sends cross-site without a preflight (`text/plain`,
  `multipart/form-data`; a form's urlencoded one when the request carries browser headers);
- a `Host` that names another machine (a dotted name or an address that is neither loopback,
  the bound address nor an allowed host): a rebound DNS name pointing at 127.0.0.1. A
  single-label name (`Host: x`) resolves in no public zone, so no web page can rebind it.
With API keys (or bound elsewhere) the keys are the guard and nothing here applies.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from cacheproxy.errors import CrossSiteRefused, HostNotAllowed

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_SIMPLE_TYPES = ("text/plain", "multipart/form-data")  # no preflight, never JSON
_FORM = "application/x-www-form-urlencoded"  # curl -d's default too: refused from browsers
_PASSED_MAX = 1024  # header combinations remembered as let through
_BROWSER_HEADERS = ("Origin", "Referer", "Sec-Fetch-Site", "Sec-Fetch-Mode")


@dataclass(frozen=True, slots=True)
class SiteGuard:
    """The host names and origins a loopback proxy without keys accepts."""

    hosts: frozenset[str]  # lower-case host names, without port; "*": any
    origins: frozenset[str]  # "scheme://host[:port]", lower-case; "*": any
    passed: set[tuple[str, str, str | None, str]] = field(default_factory=set, compare=False)

    def __call__(self, request: web.Request) -> None:
        # On the hit path: a request whose Host, Origin, Content-Type and method were let
        # through once is let through again without parsing them (bounded memo).
        headers = request.headers  # (istr names: no case-folding per lookup)
        seen = (request.method, headers.get(hdrs.HOST, ""), headers.get(hdrs.ORIGIN),
                headers.get(hdrs.CONTENT_TYPE, ""))
        if seen in self.passed:
            return
        self._check(request)
        if request.content_type.lower() != _FORM:  # (a form's verdict hangs on more headers)
            if len(self.passed) >= _PASSED_MAX:
                self.passed.clear()
            self.passed.add(seen)

    def _check(self, request: web.Request) -> None:
        host = request.headers.get("Host", "")
        if host and not self._host_ok(_hostname(host)):
            raise HostNotAllowed(f"Host {host[:100]!r} is not this proxy's (a DNS-rebound "
                                 "name?); allow it with --allowed-hosts")
        origin = request.headers.get("Origin")
        if origin is not None and not self._origin_ok(origin, host):
            raise CrossSiteRefused(f"cross-site request from Origin {origin[:100]!r} refused; "
                                   "allow it with --allowed-origins")
        if request.method == "POST" and "*" not in self.origins:
            kind = request.content_type.lower()
            if kind in _SIMPLE_TYPES or (
                    kind == _FORM and any(name in request.headers for name in _BROWSER_HEADERS)):
                raise CrossSiteRefused(f"a POST of Content-Type {kind!r} is what a browser "
                                       "sends cross-site; send application/json")

    def _host_ok(self, name: str) -> bool:
        if "*" in self.hosts or name in self.hosts or name in LOOPBACK:
            return True
        return "." not in name and ":" not in name  # single-label: not in public DNS

    def _origin_ok(self, origin: str, host: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.origins or origin in self.origins:
            return True
        parts = urlsplit(origin)
        same = parts.netloc == host.lower()  # the page was served by this proxy
        return same and parts.scheme in ("http", "https") and \
            _hostname(parts.netloc) in LOOPBACK | self.hosts


def _hostname(host: str) -> str:
    """The name of a Host header (or an origin's netloc) without its port or brackets."""
    host = host.strip().lower()
    if host.count(":") > 1 and not host.startswith("["):
        return host  # a bare IPv6 address
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


def site_guard(bound_host: str, api_keys: Iterable[str], *, hosts: Iterable[str] = (),
               origins: Iterable[str] = ()) -> SiteGuard | None:
    """The guard of a proxy bound to `bound_host`, or None where it does not apply (keys
    are configured, or the proxy listens beyond loopback)."""
    if tuple(api_keys) or not _loopback(bound_host):
        return None
    names = {_hostname(h) for h in _items(hosts)} | {bound_host.strip("[]").lower()}
    return SiteGuard(frozenset(names),
                     frozenset(o.lower().rstrip("/") for o in _items(origins)))


def guarded(route: dict[str, Any], site: SiteGuard | None) -> dict[str, Any]:
    """A route's options with the site guard run before its own guard (if any)."""
    if site is None:
        return route
    own = route.get("guard")
    if own is None:  # (the API routes without keys: one call less per request)
        return {**route, "guard": site}

    def guard(request: web.Request) -> None:
        site(request)
        if own is not None:
            own(request)

    return {**route, "guard": guard}


def _items(values: Iterable[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _loopback(host: str) -> bool:
    name = host.strip("[]").lower()
    if name in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
