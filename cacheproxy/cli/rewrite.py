"""`cacheproxy compare --cassette FILE --rewrite`: move a recorded cassette to a new runtime in
one reviewed step.

The entries of the compared namespace are replaced, in the file (rewritten atomically, as a
recording server writes it), by the candidate's answers keyed under the candidate's
fingerprint — for the entries whose meaning is unchanged (`parsed_equal`). The others are left
out and listed: their tests would now see another answer, so they are re-recorded (or the
change reviewed) rather than carried over. Entries of other namespaces stay as they are.
Keys are made in the shared scope, as `import --as-current` makes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cacheproxy.cli.compare import Comparison
from cacheproxy.cli.replay import EntryResult
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.keys.key import make_key
from cacheproxy.service.cassette import Cassette
from cacheproxy.service.fill import record_provenance


@dataclass(frozen=True, slots=True)
class Rewritten:
    """What a rewrite did: entries carried over (old key, new key), and those whose meaning
    changed (or that could not be replayed), left out."""

    carried: tuple[tuple[str, str], ...]
    changed: tuple[EntryResult, ...]


async def rewrite(path: Path, comparison: Comparison, fingerprint: Fingerprint, *,
                  record_key: bytes = b"", clock: Callable[[], float] = time.time) -> Rewritten:
    """Rewrite the cassette at `path` for the candidate that `comparison` ran on."""
    cassette = Cassette(path, read_only=False, record_key=record_key)
    await cassette.load()
    carried: list[tuple[str, str]] = []
    changed: list[EntryResult] = []
    try:
        for result in comparison.results:
            await cassette.delete(result.key)
        for result in comparison.results:
            record = _carried(result, fingerprint, clock())
            if record is None:
                changed.append(result)
                continue
            key = make_key(CanonicalRequest.from_wire(record.request), fingerprint.digest)
            await cassette.set(key, codec.encode(record))
            carried.append((result.key, key))
    finally:
        await cassette.aclose()  # writes the file (atomically)
    return Rewritten(tuple(carried), tuple(changed))


def _carried(result: EntryResult, fingerprint: Fingerprint,
             now: float) -> codec.Record | None:
    output, request = result.candidate_output, result.request
    if not result.parsed_equal or output is None or request is None:
        return None
    provenance = record_provenance(fingerprint, output, created_at=now,
                                   generation_ms=result.candidate_ms, prefill=None)
    provenance["rewritten_from"] = result.key
    return codec.Record(dict(request), output, provenance)
