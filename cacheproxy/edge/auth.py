"""Client API keys and the admin token: constant-time checks, OpenAI-shaped 401s."""

from __future__ import annotations

import hmac

import xxhash
from aiohttp import web

from cacheproxy.errors import Unauthorized


def bearer(request: web.Request) -> bytes:
    """The bearer token of the Authorization header (empty when there is none)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # A header byte that is not UTF-8 arrives as a surrogate escape: kept as the byte it was,
    # so it matches no key (a 401, not a UnicodeEncodeError).
    return token.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" \
        else b""


def matches(token: bytes, secrets: tuple[bytes, ...]) -> bool:
    """Constant-time membership: every secret is compared, whatever matches first."""
    found = False
    for secret in secrets:
        found |= hmac.compare_digest(token, secret)
    return found


def client_identity(request: web.Request, keys: tuple[bytes, ...], *,
                    header: str = "") -> str:
    """A stable, non-reversible identity for the caller's key ("" when keys are off): the
    bearer token, or (an API that takes one, as Anthropic's `x-api-key`) `header`."""
    if not keys:
        return ""
    token = bearer(request)
    if not token and header:
        token = request.headers.get(header, "").strip().encode("utf-8", "surrogateescape")
    if not token or not matches(token, keys):
        also = f" or as '{header}: <key>'" if header else ""
        raise Unauthorized("Incorrect API key provided. Pass a valid key as "
                           f"'Authorization: Bearer <key>'{also}.")
    return identity_of(token)


def identity_of(token: bytes) -> str:
    """The cache scope of an API key under `--cache-scope per-key` (not reversible)."""
    return xxhash.xxh3_64_hexdigest(token)


def check_admin(request: web.Request, token: bytes) -> None:
    """401 unless the request carries the admin token."""
    if not matches(bearer(request), (token,)):
        raise Unauthorized("admin API: wrong or missing bearer token")
