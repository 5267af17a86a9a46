"""Keep the store in step with the producer: registry at start-up, live reloads, purges.

Order on a change of the model's files (seen by the watcher once they are stable):
1. close the gate: new requests wait (bounded) instead of keying under a stale fingerprint
2. reload on the runner's lane, after the generation in progress; a failed load keeps the
   old model serving (logged, counted)
3. open the gate; if the fingerprint changed, register it and supersede the old
   namespaces of the model id, then purge them in the background (policy permitting)
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

from backends.base import Backend, BackendError, NamespacePurge
from cacheproxy.errors import Overloaded
from cacheproxy.keys.codec import CorruptRecord
from cacheproxy.keys.fingerprint import Fingerprint
from cacheproxy.runners.watcher import ModelWatcher, Snapshot
from cacheproxy.service.namespaces import Registry
from policies.invalidation import InvalidationPolicy, to_purge

log = structlog.get_logger("cacheproxy.service.invalidation")


class Reloadable(Protocol):
    """A runner whose model files can be watched and reloaded."""

    model_dir: Path | None

    @property
    def loaded_snapshot(self) -> Snapshot:
        """File identities of the model as loaded."""
        ...

    def fingerprint(self) -> Fingerprint:
        """The pinned tuple of what generates now."""
        ...

    async def reload(self) -> Fingerprint:
        """Load the files again on the lane; raises and keeps the old model on failure."""
        ...


class Invalidator:
    """Owns the registry updates, the reload gate, the watcher task and the purge tasks."""

    def __init__(
        self,
        runner: Reloadable,
        store: Backend,
        *,
        policy: InvalidationPolicy,
        reload_wait: float,
        lease_ttl: float = 30.0,
        grace: float = 60.0,
        clock: Callable[[], float] = time.time,
        registry_lock: asyncio.Lock | None = None,
    ) -> None:
        self._runner = runner
        self._store = store
        self._policy = policy
        self._reload_wait = reload_wait
        # (the models of one process share the lock: their registry changes go one at a time)
        self.registry = Registry(store, clock=clock, lock=registry_lock)
        # This replica's lease on the namespace it serves (renewed every third of it).
        self.replica = uuid.uuid4().hex[:16]
        self._lease_ttl = lease_ttl
        self._grace = grace
        self._heartbeat: asyncio.Task[None] | None = None
        self._open = asyncio.Event()
        self._open.set()
        # No reload is holding requests (the event's own method: read on every repeat HIT).
        self.is_open: Callable[[], bool] = self._open.is_set
        self._watcher: asyncio.Task[None] | None = None
        self._purges: set[asyncio.Task[None]] = set()
        self.counters = {"reloads": 0, "reload_failures": 0, "fingerprint_changes": 0,
                         "namespaces_purged": 0, "entries_purged": 0}

    async def start(self, *, watch_interval: float | None) -> None:
        """Register the serving fingerprint, supersede older ones nobody serves, start
        renewing the lease and watching."""
        await self._observe(self._runner.fingerprint())
        self._heartbeat = asyncio.create_task(self._renew())
        if watch_interval is not None and self._runner.model_dir is not None:
            watcher = ModelWatcher(self._runner.model_dir, lambda: self._runner.loaded_snapshot,
                                   self.reload, interval=watch_interval)
            self._watcher = asyncio.create_task(watcher.run())

    async def wait_ready(self) -> None:
        """Let a request through, or hold it while a reload runs (503 after reload_wait)."""
        if self._open.is_set():
            return
        try:
            async with asyncio.timeout(self._reload_wait):
                await self._open.wait()
        except TimeoutError:
            raise Overloaded("the model is reloading, retry shortly", retry_after=1.0) from None

    async def reload(self) -> None:
        """Reload the model (the watcher calls this once changed files are stable)."""
        old = self._runner.fingerprint().digest
        self._open.clear()
        try:
            new = await self._runner.reload()
        except Exception as exc:  # any load failure: the old model keeps serving
            self.counters["reload_failures"] += 1
            log.error("model_reload_failed", error=f"{type(exc).__name__}: {exc}",
                      keeps_serving=old)
            return
        finally:
            self._open.set()
        self.counters["reloads"] += 1
        if gc.get_freeze_count():  # `cacheproxy serve` froze its start-up heap, old model too
            gc.unfreeze()  # so that the replaced model can be collected
            gc.collect()
            gc.freeze()
        if new.digest != old:
            self.counters["fingerprint_changes"] += 1
            log.info("fingerprint_changed", old=old, new=new.digest)
            await self._release(old, replaced=True)  # these files are gone: no grace
            await self._observe(new)

    async def fingerprint_changed(self, old: str = "") -> None:
        """A runner saw its producer change by itself (say an upstream's engine version):
        register the new fingerprint and supersede the old namespaces."""
        self.counters["fingerprint_changes"] += 1
        if old:
            await self._release(old, replaced=True)
        await self._observe(self._runner.fingerprint())

    async def _renew(self) -> None:
        """Renew the lease every third of it (and supersede what nobody serves any more);
        a failed renewal is logged and the next one tried (a lapsed lease would let the other
        version purge a namespace this replica still serves)."""
        while True:
            await asyncio.sleep(self._lease_ttl / 3)
            try:
                await self._observe(self._runner.fingerprint())
            except Exception:
                log.exception("lease_renewal_failed")

    async def _release(self, digest: str, *, replaced: bool = False) -> None:
        try:
            await self.registry.release(digest, self.replica, replaced=replaced)
        except (BackendError, CorruptRecord) as exc:  # the lease lapses by itself then
            log.warning("registry_update_failed", error=str(exc))

    async def _observe(self, current: Fingerprint) -> None:
        try:
            superseded = await self.registry.observe(
                current, replica=self.replica, lease_ttl=self._lease_ttl, grace=self._grace)
        except BackendError as exc:
            log.warning("registry_update_failed", error=str(exc))
            return
        if superseded:
            log.info("namespaces_superseded", digests=superseded, policy=str(self._policy))
        for digest in to_purge(superseded, self._policy):
            task = asyncio.create_task(self._purge(digest))
            self._purges.add(task)
            task.add_done_callback(self._purges.discard)

    async def _purge(self, digest: str) -> None:
        if not isinstance(self._store, NamespacePurge):
            log.warning("store_cannot_purge", namespace=digest)
            return
        try:
            removed = await self._store.purge_namespace(digest)
        except BackendError as exc:
            log.warning("purge_failed", namespace=digest, error=str(exc))
            return
        self.counters["namespaces_purged"] += 1
        self.counters["entries_purged"] += removed
        log.info("namespace_purged", namespace=digest, entries=removed)

    async def idle(self) -> None:
        """Wait for the background purges in progress to finish."""
        await asyncio.gather(*self._purges, return_exceptions=True)

    async def aclose(self) -> None:
        """Cancel the watcher, the lease renewal and any purge in progress; release the
        lease (the namespace's grace period starts)."""
        tasks = [*self._purges, *(t for t in (self._watcher, self._heartbeat) if t)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._heartbeat is not None:
            await self._release(self._runner.fingerprint().digest)
