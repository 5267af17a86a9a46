"""The hot path's memos: repeated request bodies, decoded records and rendered hit bodies.

Every memo is bounded, and every entry is checked against what it was derived from, so a
memo can only skip work, never change an answer:
- parsed requests are reused only for the same body bytes, runner defaults and mode;
- a decoded record only while the store returns the very same bytes;
- a rendered hit body only for the same record object and delivery.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import orjson

from cacheproxy.canonical import Endpoint, Parsed, RunnerDefaults, parse
from cacheproxy.errors import InvalidRequest
from policies.sampling import SamplingMode

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
MAX_MEMO_BODY = 16 << 10  # bigger bodies are parsed every time


class LRU(Generic[K, V]):
    """A dict bounded by entry count and by the sizes its callers report, LRU out first."""

    def __init__(self, max_entries: int, *, max_bytes: int = 64 << 20) -> None:
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._max = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0

    def get(self, key: K) -> V | None:
        """The value, marked as recently used."""
        item = self._data.get(key)
        if item is None:
            return None
        self._data.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V, *, size: int = 0) -> None:
        """Insert or replace, evicting least recently used entries past either bound."""
        old = self._data.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        if size > self._max_bytes:
            return  # would evict everything else: not worth remembering
        self._data[key] = (value, size)
        self._bytes += size
        while len(self._data) > self._max or self._bytes > self._max_bytes:
            _, (_, dropped) = self._data.popitem(last=False)
            self._bytes -= dropped


def decode_body(raw: bytes) -> object:
    """JSON body -> Python; 400 on anything that is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


class ParseMemo:
    """Repeated identical bodies skip JSON decoding and canonicalization."""

    def __init__(self, max_entries: int = 4096, *, max_tokens_cap: int | None = None) -> None:
        self._memo: LRU[tuple[Endpoint, bytes], tuple[RunnerDefaults, SamplingMode, Parsed]] = \
            LRU(max_entries)
        self._cap = max_tokens_cap

    def parse(
        self, raw: bytes, endpoint: Endpoint, defaults: RunnerDefaults, mode: SamplingMode
    ) -> Parsed:
        """Same as canonical.parse(decode_body(raw), ...), remembered for small bodies."""
        memo_key = (endpoint, raw)
        known = self._memo.get(memo_key) if len(raw) <= MAX_MEMO_BODY else None
        # Valid only under the same defaults object (a reload makes new ones) and mode.
        if known is not None and known[0] is defaults and known[1] == mode:
            return known[2]
        parsed = parse(decode_body(raw), endpoint, defaults, mode, max_tokens_cap=self._cap)
        if len(raw) <= MAX_MEMO_BODY:
            self._memo.put(memo_key, (defaults, mode, parsed), size=2 * len(raw))
        return parsed


class ResponseIds:
    """Unique response ids without a uuid4 per response: a random prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count()

    def next(self, endpoint: Endpoint) -> str:
        """`chatcmpl-…` or `cmpl-…`."""
        head = "chatcmpl-" if endpoint == "chat" else "cmpl-"
        return f"{head}{self._prefix}{next(self._counter):012x}"


ID_MARK = "@@cacheproxy-id@@"
CREATED_MARK = 9_999_999_999_999
_ID_BYTES = f'"id":"{ID_MARK}"'.encode()
_CREATED_BYTES = f'"created":{CREATED_MARK}'.encode()


class HitTemplates:
    """Rendered hit bodies with the response id and creation time left to splice in."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._memo: LRU[Hashable, tuple[object, bytes]] = LRU(max_entries)

    def body(self, key: Hashable, source: object, render: Callable[[], bytes],
             response_id: str, created: int) -> bytes:
        """The rendered body for `key`, re-rendered when `source` is another object."""
        known = self._memo.get(key)
        if known is None or known[0] is not source:
            known = (source, render())
            self._memo.put(key, known, size=len(known[1]))
        # Inside JSON strings quotes are escaped, so these byte runs only match the fields.
        return known[1].replace(_ID_BYTES, f'"id":"{response_id}"'.encode()).replace(
            _CREATED_BYTES, f'"created":{created}'.encode())
