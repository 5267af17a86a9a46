"""The hit path's memos: everything a repeated request may skip, and the rule that lets it.

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
- `HitTemplates` — rendered hit bodies, with the response id and creation time left open
  (`Template`), by (key, delivery, logprobs). Valid for the record object they were
  rendered from.
- `Repeats` — a whole HIT (`Repeat`: key, stored bytes, template, header block, log fields)
  by (endpoint, cache scope, body bytes), for requests without Cache-Control. Valid while
  no reload is in progress, the runner serves the very fingerprint object the HIT was keyed
  under, the store's breaker is closed and the store still returns the same bytes under the
  key (checked without I/O where the store holds its values in this process).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import msgpack

from cacheproxy.keys import codec
from cacheproxy.keys.budget import SCHEMA_FIELDS, SchemaFields
from cacheproxy.keys.canonical import Parsed, Route, RunnerDefaults
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.keys.key import CacheKey
from cacheproxy.observe.logs import SharedFields
from policies.sampling import SamplingMode

if TYPE_CHECKING:
    from cacheproxy.service.parsing import ParseMemo

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
MAX_MEMO_BODY = 16 << 10  # bigger bodies are parsed every time
LARGE_BODY = 64 << 10  # hit bodies above it are sent as pieces of their template, not copied


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


ID_MARK = "@@cacheproxy-id@@"
CREATED_MARK = 9_999_999_999_999
_ID_BYTES = f'"id":"{ID_MARK}"'.encode()
_CREATED_BYTES = f'"created":{CREATED_MARK}'.encode()
# Every marked field: the id, and the times (a Responses object has "created_at" and
# "completed_at": the same second as "created" in a chat completion).
_MARKS = re.compile(b'"id":"' + ID_MARK.encode() + b'"|"(?:created|created_at|completed_at)":'
                    + str(CREATED_MARK).encode())
_TIME_DIGITS = len(str(CREATED_MARK))


def _between_marks(body: bytes) -> bytes | None:
    """The bytes between the id and the creation time, when every id is followed by its
    creation time with these same bytes in between (as in every chat completion cacheproxy
    renders); None otherwise."""
    ids = body.count(_ID_BYTES)
    start = body.find(_ID_BYTES) + len(_ID_BYTES)
    end = body.find(_CREATED_BYTES, start)
    if ids == 0 or end < 0 or body.count(_CREATED_BYTES) != ids:
        return None
    between = body[start:end]
    if body.count(_ID_BYTES + between + _CREATED_BYTES) != ids or \
            len(_MARKS.findall(body)) != 2 * ids:
        return None
    return between


@dataclass(frozen=True, slots=True)
class Template:
    """A rendered hit body with the response id and creation time left to fill in."""

    body: bytes  # with ID_MARK and CREATED_MARK where the values go
    content_type: str
    # The parts of the body around its marked fields. A chat completion (and each chunk of
    # its stream) has the id then "created" with the same bytes between: filled as a join
    # of the parts around each such run, a quarter of the cost of a value per mark. Any
    # other shape (a Responses object) is filled mark by mark (`_marks`).
    _parts: tuple[bytes, ...] = field(init=False, repr=False, compare=False, default=())
    _between: bytes | None = field(init=False, repr=False, compare=False, default=None)
    _marks: tuple[bytes, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        between = _between_marks(self.body)
        if between is not None:
            object.__setattr__(self, "_between", between)
            parts = self.body.split(_ID_BYTES + between + _CREATED_BYTES)
        else:
            object.__setattr__(self, "_marks", tuple(_MARKS.findall(self.body)))
            parts = _MARKS.split(self.body)
        object.__setattr__(self, "_parts", tuple(parts))

    def render(self, response_id: str, created: int) -> bytes | list[bytes]:
        """The body with its response id and creation time: over LARGE_BODY as `pieces` (a
        response then shares the template's bytes, so a client that does not read holds no
        copy of its answer), else as one bytes."""
        if len(self.body) > LARGE_BODY:
            return self.pieces(response_id, created)
        return self.fill(response_id, created)

    def fill(self, response_id: str, created: int) -> bytes:
        """The body with its response id and creation time."""
        if self._between is not None:
            return (b'"id":"%b"%b"created":%d' % (response_id.encode(), self._between, created)
                    ).join(self._parts)
        return b"".join(self.pieces(response_id, created))

    def pieces(self, response_id: str, created: int) -> list[bytes]:
        """What `fill` returns, as the template's own parts with the filled fields between
        (nothing copied)."""
        out = [b""] * (2 * len(self._parts) - 1)
        out[::2] = self._parts
        if self._between is not None:
            filled = b'"id":"%b"%b"created":%d' % (response_id.encode(), self._between,
                                                   created)
            out[1::2] = [filled] * (len(self._parts) - 1)
            return out
        values = {mark: b'"id":"%b"' % response_id.encode() if mark == _ID_BYTES else
                  mark[:-_TIME_DIGITS] + b"%d" % created for mark in set(self._marks)}
        out[1::2] = [values[mark] for mark in self._marks]
        return out


class HitTemplates:
    """Rendered hit bodies, one per record and delivery."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._memo: LRU[Hashable, tuple[object, Template]] = LRU(max_entries)

    def get(self, key: Hashable, source: object, render: Callable[[], Template]) -> Template:
        """The template for `key`, rendered again when `source` is another object."""
        known = self._memo.get(key)
        if known is None or known[0] is not source:
            known = (source, render())
            self._memo.put(key, known, size=2 * len(known[1].body))  # body and its parts
        return known[1]


@dataclass(frozen=True, slots=True)
class Repeat:
    """Everything a HIT response to one exact request body needed, kept for its repeats
    (valid under the rule in the module docstring)."""

    fingerprint: Fingerprint  # the very object the HIT was keyed under (compared by `is`)
    key: CacheKey
    data: bytes
    endpoint: Route
    created_at: float
    template: Template
    head: bytes  # header lines but Age (and Cache-Control under a TTL): they change with time
    log: SharedFields  # the request's cache log fields


RepeatKey = tuple[Route, str, bytes]
"""(route, cache scope, raw body)."""


class Repeats:
    """Remembered HITs by (endpoint, cache scope, raw body)."""

    def __init__(self, max_entries: int = 4096, *, max_bytes: int = 64 << 20) -> None:
        self._memo: LRU[RepeatKey, Repeat] = LRU(max_entries, max_bytes=max_bytes)
        # The remembered hit of exactly this request, if any (the LRU's own method: one
        # call less on every repeat HIT).
        self.get: Callable[[RepeatKey], Repeat | None] = self._memo.get

    def remember(self, memo_key: RepeatKey, repeat: Repeat) -> None:
        """Keep a hit for the repeats of a small request body."""
        raw = memo_key[2]
        if len(raw) <= MAX_MEMO_BODY:
            size = len(raw) + len(repeat.data) + 2 * len(repeat.template.body)
            self._memo.put(memo_key, repeat, size=size)

    def forget(self, memo_key: RepeatKey) -> None:
        """Drop an entry that no longer matches the store."""
        self._memo.pop(memo_key)


@dataclass(frozen=True, slots=True)
class Memos:
    """The memos of one service."""

    parser: ParseMemo  # (service/parsing.py)
    decoded: DecodedRecords = field(default_factory=DecodedRecords)
    templates: HitTemplates = field(default_factory=HitTemplates)
    repeats: Repeats = field(default_factory=Repeats)
