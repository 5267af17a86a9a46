"""Cross-replica single-flight: one generation per key across every proxy on a shared store.

Inside one replica, `flights` already runs one fill per key. Across replicas, the fill first
takes a lease on the key in the store (SET NX PX, renewed while generating). A replica that
finds the lease taken waits for the owner's release (pub/sub where the store has it, polling
as the fallback) and serves the stored value (COALESCED); if the owner dies, its lease
expires and a waiter takes over and generates.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from backends.base import BackendError, DistributedLock, Notify

log = structlog.get_logger("cacheproxy.service.fleet")
R = TypeVar("R")


def lock_name(key: str) -> str:
    """Leases live outside every namespace, so scans and purges never see them."""
    return f"_lock/{key}"


def channel_name(lock: str) -> str:
    """The pub/sub channel a lease's release is announced on."""
    return f"_released/{lock}"


class Lease:
    """A held lease, renewed in the background until released."""

    def __init__(self, store: DistributedLock, name: str, owner: str, ttl: float) -> None:
        self._store, self._name, self._owner, self._ttl = store, name, owner, ttl
        self._renewer = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                if not await self._store.renew_lock(self._name, self._owner, self._ttl):
                    log.warning("lease_lost", lock=self._name)
                    return
            except BackendError as exc:
                log.warning("lease_renew_failed", lock=self._name, error=str(exc))

    async def release(self) -> None:
        """Stop renewing, give the lease back, and wake the replicas waiting on it."""
        self._renewer.cancel()
        await asyncio.gather(self._renewer, return_exceptions=True)
        try:
            await self._store.unlock(self._name, self._owner)
            if isinstance(self._store, Notify):
                await self._store.notify(channel_name(self._name))
        except BackendError as exc:  # it expires by itself; waiters poll
            log.warning("unlock_failed", lock=self._name, error=str(exc))


class Fleet:
    """Leases over a store that offers them."""

    def __init__(self, store: DistributedLock, *, lock_ttl: float, poll: float = 0.05,
                 wait: float = 300.0) -> None:
        self._store = store
        self._ttl = lock_ttl
        self._poll = poll
        self._wait = wait
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"

    async def lead_or_follow(
        self, key: str, lookup: Callable[[], Awaitable[R | None]]
    ) -> Lease | R | None:
        """A Lease when this replica should generate, or what another replica stored.

        None when the store cannot lease (down) or the wait ran out: generate without one.
        """
        deadline = time.monotonic() + self._wait
        name = lock_name(key)
        while time.monotonic() < deadline:
            try:
                if await self._store.try_lock(name, self.owner, self._ttl):
                    lease = Lease(self._store, name, self.owner, self._ttl)
                    # The previous owner may have stored it and let go just before we asked.
                    try:
                        found = await lookup()
                    except BaseException:
                        await lease.release()
                        raise
                    if found is not None:
                        await lease.release()
                        return found
                    return lease
            except BackendError as exc:
                log.warning("lease_unavailable", lock=name, error=str(exc))
                return None
            found = await lookup()
            if found is not None:
                return found
            await self._await_release(name)  # the owner is generating (or died: its lease expires)
        return None

    async def _await_release(self, name: str) -> None:
        """Until the owner announces its release (pub/sub), or one poll interval without it.

        A release announced between our lookup and our subscription is missed: the longer
        poll interval under pub/sub bounds that case."""
        if not isinstance(self._store, Notify):
            await asyncio.sleep(self._poll)
            return
        try:
            await self._store.wait_notified(channel_name(name), within=self._poll * 10)
        except BackendError:
            await asyncio.sleep(self._poll)
