"""Rendered bodies with the response id and creation time left open (`Template`), and their
memos: a stored answer is rendered once per record and delivery (`HitTemplates`), a
generated one once per flight and delivery (`FlightBodies`); each response fills in its own
id and time."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

from cacheproxy.service.memos import LRU

LARGE_BODY = 64 << 10  # hit bodies above it are sent as pieces of their template, not copied

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


class FlightBodies:
    """Whole answers of a flight, rendered once for all its readers of one delivery (the id
    and time filled per reader), kept while the flight lives (its readers hold it)."""

    def __init__(self) -> None:
        self._by_flight: WeakKeyDictionary[object, dict[Hashable, Template]] = \
            WeakKeyDictionary()

    def get(self, flight: object, key: Hashable, render: Callable[[], Template]) -> Template:
        """The template of `flight`'s answer for `key`, rendered by the first reader."""
        rendered = self._by_flight.get(flight)
        if rendered is None:
            rendered = self._by_flight[flight] = {}
        template = rendered.get(key)
        if template is None:
            template = rendered[key] = render()
        return template
