"""Cache keys: xxh3_128 over msgpack of (schema, fingerprint, endpoint, canonical request)."""

from __future__ import annotations

import msgpack
import xxhash

from cacheproxy.keys.canonical import CanonicalRequest

# Bump when the canonical form or the key layout changes: old entries become unreachable.
KEY_SCHEMA = 1


def make_key(request: CanonicalRequest, fingerprint: str, *, scope: str = "") -> str:
    """`<fingerprint digest>/<request hash>`: prefixed by namespace so purges never scan others.

    The hashed bytes are msgpack of [KEY_SCHEMA, fingerprint, endpoint, scope, wire]; the
    request part is packed once per request (`request.packed`) and spliced in.
    """
    head = msgpack.packb([KEY_SCHEMA, fingerprint, request.endpoint, scope], use_bin_type=True)
    # 0x94 is a 4-array header; 0x95 makes the same bytes a 5-array with `packed` appended.
    payload = b"\x95" + head[1:] + request.packed
    return f"{fingerprint}/{xxhash.xxh3_128_hexdigest(payload)}"


def namespace_of(key: str) -> str:
    """The fingerprint digest a key lives under."""
    return key.partition("/")[0]
