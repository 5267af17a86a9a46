"""Content digests of model files, remembered per (path, size, mtime_ns, inode).

A multi-GB quant file is hashed once per version: the memo lives in a small side file
under the cache directory, and a progress bar shows when hashing takes a while.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import xxhash

CHUNK = 16 << 20
PROGRESS_ABOVE = 256 << 20  # bytes; smaller files hash in well under a second


def file_identity(path: Path) -> str:
    """What must stay the same for a remembered digest to still be valid."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


class DigestMemo:
    """Remembered digests in a JSON side file; a missing or broken file is an empty memo."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._memo: dict[str, str] = {}
        if path is not None and path.exists():
            try:
                loaded = json.loads(path.read_text())
                self._memo = {k: v for k, v in loaded.items() if isinstance(v, str)}
            except (OSError, ValueError, AttributeError):
                self._memo = {}
        self.hashed: list[str] = []  # files actually read, for tests and logs

    def digest(self, path: Path) -> str:
        """xxh3_128 of the file's content, from the memo when the file is unchanged."""
        identity = file_identity(path)
        if (known := self._memo.get(identity)) is not None:
            return known
        value = hash_file(path)
        self.hashed.append(str(path))
        self._memo[identity] = value
        self._save()
        return value

    def _save(self) -> None:
        if self._path is None:
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=".digests-")
            with os.fdopen(fd, "w") as f:
                json.dump(self._memo, f)
            os.replace(tmp, self._path)  # atomic: readers never see half a file
        except OSError:
            pass  # the memo is an optimisation; hashing again is always correct


def hash_file(path: Path) -> str:
    """xxh3_128 of a file's bytes, with a progress bar for big files."""
    size = path.stat().st_size
    h = xxhash.xxh3_128()
    bar = None
    if size > PROGRESS_ABOVE:
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {path.name}")
    with path.open("rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            if bar is not None:
                bar.update(n)
    if bar is not None:
        bar.close()
    return h.hexdigest()


def hash_files(paths: list[Path], memo: DigestMemo | None = None) -> str:
    """One digest over several files in the given order, each framed by name and size."""
    h = xxhash.xxh3_128()
    for path in paths:
        content = memo.digest(path) if memo is not None else hash_file(path)
        h.update(f"{path.name}\0{path.stat().st_size}\0{content}\0".encode())
    return h.hexdigest()
