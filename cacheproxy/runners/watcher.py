"""Watch a model directory with a cheap stat poll; report a change once the files are stable.

A file being written (its size or mtime still moving between two polls) is never reported:
only a snapshot that stayed the same for one whole interval and differs from the loaded one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from cacheproxy.keys.fingerprint import watched_files

Snapshot = dict[str, tuple[int, int, int]]


def snapshot(model_dir: Path) -> Snapshot:
    """(size, mtime_ns, inode) of every file whose change changes the fingerprint."""
    out: Snapshot = {}
    for path in watched_files(model_dir):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # deleted between listing and stat: the next poll sees the new state
        out[path.name] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


class ModelWatcher:
    """Polls a directory; calls `on_change` with the stable new snapshot."""

    def __init__(
        self,
        model_dir: Path,
        loaded: Callable[[], Snapshot],
        on_change: Callable[[], Awaitable[None]],
        *,
        interval: float,
    ) -> None:
        self._dir = model_dir
        self._loaded = loaded
        self._on_change = on_change
        self._interval = interval
        self._failed: Snapshot | None = None
        self.polls = 0

    async def run(self) -> None:
        """Poll until cancelled."""
        pending: Snapshot | None = None
        while True:
            await asyncio.sleep(self._interval)
            current = await asyncio.to_thread(snapshot, self._dir)
            self.polls += 1
            if current == self._loaded() or current == self._failed:
                pending = None
                continue
            if current != pending:
                pending = current  # still moving, or just changed: wait one more interval
                continue
            pending = None
            await self._on_change()
            # A load that failed on these exact files is not retried until they change again.
            self._failed = None if self._loaded() == current else current
