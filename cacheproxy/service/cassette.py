"""`jsonl:///path/to/cassette.jsonl`: a recording that lives with the tests.

A memory store that is read from a JSON-lines file at start-up (the export format of
`keys.transcript`: one verified record a line) and written back at shutdown and on
`POST /admin/flush` (to a temporary file renamed over the old one, so a crash leaves the old
recording whole), unless the server replays: then the file is only read. A line that does not
verify stops the start-up, naming its line; with a record key, so does a line that is not
signed with it, and every line written is signed. The namespace registry is rebuilt from the
records' provenance; the file holds records only, sorted by key (diffs stay small), each in a
machine-neutral form (`neutral`: two machines recording the same answers write the same
provenance but for the time of recording).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from backends import open_backend
from backends.base import Backend
from backends.memory import MemoryBackend
from cacheproxy.keys import codec, transcript
from cacheproxy.service.namespaces import REGISTRY_KEY, Namespace, Registry

UNBOUNDED = 1 << 40  # a recording is never evicted


class Cassette(MemoryBackend):
    """The memory store of a recording file."""

    def __init__(self, path: Path, *, read_only: bool, record_key: bytes = b"") -> None:
        super().__init__(max_bytes=UNBOUNDED)
        self.path = path
        self.read_only = read_only
        self._secret = record_key
        self._flushing = asyncio.Lock()

    def __repr__(self) -> str:
        return f"Cassette({str(self.path)!r})"

    async def load(self) -> int:
        """Read the file (a missing one is an empty recording); the entries it held."""
        if not self.path.exists():
            return 0
        namespaces: dict[str, Namespace] = {}
        entries = 0
        with self.path.open("rb") as lines:
            for key, record in transcript.read(lines, str(self.path), secret=self._secret):
                await self.set(key, codec.encode(record))
                _register(namespaces, key, record)
                entries += 1
        if namespaces:
            await Registry(self).save(namespaces)
        return entries

    async def flush(self) -> int:
        """Write every record to the file, atomically; the number written (0: read-only).
        One flush at a time; the lines are taken in one go, written in a thread."""
        if self.read_only:
            return 0
        async with self._flushing:
            keys: list[str] = []
            while page := await self.scan("", after=keys[-1] if keys else ""):
                keys.extend(page)
            lines = []
            for key in sorted(keys):
                data = await self.get(key)
                if key != REGISTRY_KEY and data is not None:
                    lines.append(transcript.to_line(key, neutral(codec.decode(data)),
                                                    secret=self._secret))
            await asyncio.to_thread(self._write, lines)
            return len(lines)

    def _write(self, lines: list[bytes]) -> None:
        descriptor, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.",
                                                 dir=self.path.parent)
        try:
            os.fchmod(descriptor, 0o644)  # (mkstemp makes it 0600): a file to commit
            with os.fdopen(descriptor, "wb") as out:
                out.writelines(lines)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            os.unlink(temporary)
            raise

    async def aclose(self) -> None:
        """Write the recording back (unless read-only), then close."""
        if not self._closed:
            await self.flush()
        await super().aclose()


MACHINE_FIELDS = ("model_path",)  # fingerprint fields that name a place on one machine


def _neutral_fields(fields: object) -> object:
    if not isinstance(fields, dict):
        return fields
    neutral = dict(fields)
    for name in (*MACHINE_FIELDS, "model_id"):
        value = neutral.get(name)
        if isinstance(value, str) and os.path.isabs(value):
            neutral[name] = Path(value).name  # the directory's name, not where it is
    return neutral


def neutral(record: codec.Record) -> codec.Record:
    """A record as a recording keeps it: nothing that differs between two machines recording
    the same answer — model directories by name only (a model id that is a path too), no
    generation time (the machine's speed). The digests that identify the files stay."""
    provenance = {k: v for k, v in record.provenance.items() if k != "generation_ms"}
    for name in ("fingerprint_fields", "imported_from_fields"):
        if name in provenance:
            provenance[name] = _neutral_fields(provenance[name])
    return codec.Record(record.request, record.output, provenance)


def _register(namespaces: dict[str, Namespace], key: str, record: codec.Record) -> None:
    digest = key.partition("/")[0]
    if digest in namespaces:
        return
    fields = record.provenance.get("fingerprint_fields") or {}
    now = time.time()
    namespaces[digest] = Namespace(digest, str(fields.get("model_id", "")), dict(fields),
                                   now, now, "current")


async def open_store(url: str, *, replay: bool = False, record_key: bytes = b"") -> Backend:
    """The store a URL names: a recording (jsonl://, loaded now, its lines signed with and
    checked against the record key if one is given) or a backend's."""
    if url.startswith("jsonl://"):
        path = Path(url.removeprefix("jsonl://"))
        if not path.is_absolute():
            raise ValueError(f"store URL {url!r}: jsonl:// takes an absolute path "
                             "(jsonl:///path/to/cassette.jsonl)")
        cassette = Cassette(path, read_only=replay, record_key=record_key)
        await cassette.load()
        return cassette
    return open_backend(url)
