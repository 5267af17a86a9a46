"""A circuit breaker for the store: a dead store costs one fast failure, not one per request.

closed    -> every call goes to the store; a failure (error or timeout) opens the breaker
open      -> calls are refused at once for `cooldown` seconds (requests BYPASS the store)
half-open -> after the cooldown one call is let through; success closes, failure re-opens
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from backends.base import BackendError

T = TypeVar("T")


class StoreUnavailable(Exception):
    """The breaker is open, or the store just failed: treat the store as absent."""


class Breaker:
    """Guards store calls with a timeout and a cooldown after failures."""

    def __init__(self, *, timeout: float, cooldown: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout = timeout
        self._cooldown = cooldown
        self._clock = clock
        self._open_until = 0.0
        self._probing = False
        self.trips = 0

    @property
    def state(self) -> str:
        """closed, open or half-open."""
        if self._open_until == 0.0:
            return "closed"
        return "open" if self._clock() < self._open_until else "half-open"

    async def call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run one store operation; StoreUnavailable when the breaker refuses or it fails."""
        state = self.state
        if state == "open" or (state == "half-open" and self._probing):
            raise StoreUnavailable("store circuit open")
        self._probing = state == "half-open"
        try:
            async with asyncio.timeout(self._timeout):
                result = await operation()
        except (BackendError, TimeoutError) as exc:
            self._trip()
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._probing = False
        self._open_until = 0.0
        return result

    def _trip(self) -> None:
        self.trips += 1
        self._open_until = self._clock() + self._cooldown
