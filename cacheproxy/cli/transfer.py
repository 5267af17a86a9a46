"""`cacheproxy export | import`: a store's entries as JSON lines, and back, verified.

Export writes one line per entry (`keys.transcript`: key, canonical request, the answer as
text and as chunks, provenance, checksum), sorted by key. Import checks every line before it
writes any: a line that does not verify is refused with its number, and so is an entry of
another fingerprint than the serving one (unless `--as-current`: then it is keyed anew under
the serving fingerprint, its provenance says where it came from, and `verify` can audit it).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO, TextIO

from backends import listing
from backends.base import Backend
from cacheproxy.keys import codec, transcript
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.keys.key import make_key
from cacheproxy.service.cassette import open_store
from cacheproxy.service.namespaces import REGISTRY_KEY, Registry


async def _keys(store: Backend, prefix: str) -> list[str]:
    return [k for k in await listing.keys(store, prefix) if k != REGISTRY_KEY]


async def export(url: str, *, namespace: str | None, model: str | None, out: BinaryIO,
                 record_key: bytes = b"") -> int:
    """Write the entries of a namespace, of a model's namespaces, or of the whole store
    (each line signed with the record key, when one is given)."""
    store = await open_store(url, replay=True, record_key=record_key)
    try:
        registry = await Registry(store).load()
        if namespace is not None:
            prefixes = [namespace + "/"]
        elif model is not None:
            prefixes = [d + "/" for d, ns in registry.items() if ns.model_id == model]
        else:
            prefixes = [""]
        written = 0
        for prefix in prefixes:
            for key in await _keys(store, prefix):  # sorted
                data = await store.get(key)
                if data is None:
                    continue  # expired or purged meanwhile
                out.write(transcript.to_line(key, codec.decode(data), secret=record_key))
                written += 1
    finally:
        await store.aclose()
    return written


def read_lines(path: Path, *, record_key: bytes = b"") -> list[tuple[str, codec.Record]]:
    """Every (key, record) of a file, read a bounded line at a time; ValueError naming the
    first line that fails (too long, malformed, unverified, unsigned with a record key)."""
    with path.open("rb") as lines:
        return list(transcript.read(lines, str(path), secret=record_key))


def _as_current(number: int, key: str, record: codec.Record, current: Fingerprint
                ) -> tuple[str, codec.Record]:
    request = CanonicalRequest.from_wire(record.request)
    old = key.partition("/")[0]
    if make_key(request, old) != key:
        raise ValueError(f"line {number}: {key} is not the key of its request under its "
                         "fingerprint: keyed for one API key's tenant (per-key scope, which the "
                         "record does not name) or by an older cacheproxy (another key schema);"
                         " it cannot be keyed anew")
    provenance = {**record.provenance, "fingerprint": current.digest,
                  "fingerprint_fields": current.fields(), "imported_from": old,
                  "imported_from_fields": record.provenance.get("fingerprint_fields"),
                  "imported_at": time.time()}
    return make_key(request, current.digest), replace(record, provenance=provenance)


async def import_(path: Path, url: str, *, current: Fingerprint, as_current: bool,
                  err: TextIO | None = None, record_key: bytes = b"") -> int:
    """Load a file into a store; every line is checked before anything is written."""
    err = err or sys.stderr  # (looked up per call: a default would be the import's)
    entries = read_lines(path, record_key=record_key)
    checked = []
    for number, (key, record) in enumerate(entries, 1):
        if key.partition("/")[0] != current.digest:
            if not as_current:
                raise ValueError(f"{path}: line {number}: {key} was produced under fingerprint "
                                 f"{key.partition('/')[0]}, not the serving {current.digest};"
                                 " pass --as-current to key it under the serving one")
            key, record = _as_current(number, key, record, current)
        checked.append((key, record))
    store = await open_store(url, record_key=record_key)
    try:
        for key, record in checked:
            await store.set(key, codec.encode(record))
        if checked:
            await _register(store, current)
    finally:
        await store.aclose()
    print(f"imported {len(checked)} entries into {url}", file=err)
    return len(checked)


async def _register(store: Backend, current: Fingerprint) -> None:
    """Register the serving namespace, which every imported entry is in by now (without
    superseding any other)."""
    await Registry(store).register(current)
