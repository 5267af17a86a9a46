"""The service's memos of the hit path: what a repeated request may skip, and the rule that
lets it. (The memos of rendered bytes are the edge's: edge/templates.py, edge/repeats.py.)

Each memo is bounded (entries and reported bytes, least recently used out first) and each
remembered value is used only while what it was derived from is unchanged, so a memo can
only skip work, never change an answer:

- `ParseMemo` (service/parsing.py) — parsed requests (`Parsed`) by (endpoint, cache scope,
  body bytes) for bodies up to MAX_MEMO_BODY (the scope: under `per-key` no tenant's parse
  is faster for a body another tenant sent, so timing tells nobody what others ask). Valid while the
  runner's defaults are the very object they were parsed under (a reload makes new ones)
  and the sampling mode is the same.
- `DecodedRecords` — decoded records and their packed canonical request by key. Valid while
  the store returns the very same bytes under that key.

A remembered HIT (`proxy.Held`: key, stored bytes, the fingerprint object it was keyed
under) is the service's to vouch for again (`CachingProxy.holds`, `still_stored`): while no
reload is in progress, the runner serves that very fingerprint object, the store's breaker is
closed and the store still returns the same bytes under the key (checked without I/O where
the store holds its values in this process).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import msgpack

from cacheproxy.keys import codec
from cacheproxy.keys.budget import SCHEMA_FIELDS, SchemaFields
from cacheproxy.keys.canonical import Parsed, RunnerDefaults
from policies.sampling import SamplingMode

if TYPE_CHECKING:
    from cacheproxy.service.parsing import ParseMemo

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
MAX_MEMO_BODY = 16 << 10  # bigger bodies are parsed (and their HITs rendered) every time


class LRU(Generic[K, V]):
    """A dict bounded by entry count and by the sizes its callers report, LRU out first."""

    def __init__(self, max_entries: int, *, max_bytes: int = 64 << 20) -> None:
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._max = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0

    def keys(self) -> list[K]:
        """The keys, least recently used first."""
        return list(self._data)

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

    def pop(self, key: K) -> None:
        """Remove key if present."""
        old = self._data.pop(key, None)
        if old is not None:
            self._bytes -= old[1]


class Parse(Protocol):
    """A decoded body of one API -> its canonical request (the edge's table of APIs)."""

    def __call__(self, body: object, defaults: RunnerDefaults, mode: SamplingMode, *,
                 max_tokens_cap: int | None = None,
                 max_answer_tokens: int | None = None) -> Parsed: ...


@dataclass(frozen=True, slots=True)
class BodyParser:
    """An API's parse, and the fields of its bodies that may carry schemas: those are counted
    against the schema budget, and a body with any is parsed off the loop (service/parsing)."""

    parse: Parse
    schema_fields: SchemaFields = SCHEMA_FIELDS


class DecodedRecords:
    """Stored bytes decoded once: the record and its canonical request, packed for the check
    that it is this request's."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._memo: LRU[str, tuple[bytes, codec.Record, bytes]] = LRU(max_entries)

    def decode(self, key: str, data: bytes) -> tuple[codec.Record, bytes]:
        """(record, packed request) of `data`; raises codec.CorruptRecord."""
        known = self._memo.get(key)
        if known is not None and known[0] == data:  # bytes compare identity first
            return known[1], known[2]
        record = codec.decode(data)
        packed = msgpack.packb(record.request, use_bin_type=True)
        # A decoded record takes a few times its encoded size in memory.
        self._memo.put(key, (data, record, packed), size=4 * len(data))
        return record, packed


@dataclass(frozen=True, slots=True)
class Memos:
    """The memos of one service."""

    parser: ParseMemo  # (service/parsing.py)
    decoded: DecodedRecords = field(default_factory=DecodedRecords)
