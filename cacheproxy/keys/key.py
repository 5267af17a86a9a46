"""Cache keys: xxh3_128 over msgpack of (schema, fingerprint, endpoint, scope, request)."""

from __future__ import annotations

import msgpack
import xxhash

from cacheproxy.keys.canonical import CanonicalRequest

# Bump when the canonical form or the key layout changes: old entries become unreachable.
KEY_SCHEMA = 3  # 3: the model's name left the canonical request


class CacheKey(str):
    """`<namespace>/<request hash>`: the fingerprint digest the entry lives under (so purges
    never scan other namespaces), then the hash of the request. A str, as stores take it."""

    __slots__ = ()

    @property
    def namespace(self) -> str:
        """The fingerprint digest part."""
        return self.partition("/")[0]

    @property
    def request_hash(self) -> str:
        """The request part: what tells two entries of one namespace apart."""
        return self.partition("/")[2]

    @property
    def short(self) -> str:
        """The first 12 digits of the request hash, for log lines."""
        return self.request_hash[:12]


def make_key(request: CanonicalRequest, fingerprint: str, *, scope: str = "") -> CacheKey:
    """The key of `request` under `fingerprint` (and the tenant `scope`, when per-key).

    The hashed bytes are msgpack of [KEY_SCHEMA, fingerprint, endpoint, scope, wire]; the
    request part is packed once per request (`request.packed`) and spliced in.
    """
    head = msgpack.packb([KEY_SCHEMA, fingerprint, request.endpoint, scope], use_bin_type=True)
    # 0x94 is a 4-array header; 0x95 makes the same bytes a 5-array with `packed` appended.
    payload = b"\x95" + head[1:] + request.packed
    return CacheKey(f"{fingerprint}/{xxhash.xxh3_128_hexdigest(payload)}")
