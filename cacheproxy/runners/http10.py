"""HTTP/1.0 as the upstream reader speaks it: where a URL points, the request head, and the
status and length of a response head. No I/O here."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from functools import cache
from urllib.parse import urlsplit

from cacheproxy.errors import UpstreamUnavailable

MAX_HEAD = 64 * 1024  # bytes of status line and headers


@dataclass(frozen=True, slots=True)
class Target:
    """Where an upstream URL points: host, port, TLS, and the path prefix."""

    host: str
    port: int
    tls: bool
    prefix: str


@cache
def target(url: str) -> Target:
    """Parse an upstream URL once."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    if parts.hostname is None:
        raise ValueError(f"no host in the upstream URL {url!r}")
    return Target(parts.hostname, parts.port or (443 if tls else 80), tls,
                  parts.path.rstrip("/"))


@cache
def tls() -> ssl.SSLContext:
    """The default TLS context, made once."""
    return ssl.create_default_context()


def request_head(t: Target, path: str, length: int) -> bytes:
    """The head of a JSON POST: HTTP/1.0, no keep-alive."""
    host = t.host if ":" not in t.host else f"[{t.host}]"
    return (f"POST {t.prefix}{path} HTTP/1.0\r\nHost: {host}:{t.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n").encode("latin-1")


def parse_head(head: bytes) -> tuple[int, int | None]:
    """Status and Content-Length of a response head; a chunked or garbled head is an error."""
    lines = head.split(b"\r\n")
    status_line = lines[0].split(None, 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/") or \
            not status_line[1].isdigit():
        raise UpstreamUnavailable(f"the upstream sent no HTTP status line: {lines[0][:80]!r}")
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding" and value.strip().lower() != b"identity":
            raise UpstreamUnavailable("the upstream answered an HTTP/1.0 request with "
                                      f"Transfer-Encoding {value.strip().decode('latin-1')}")
        if name == b"content-length" and value.strip().isdigit():
            length = int(value)
    return int(status_line[1]), length
