"""A circuit breaker for the store: a dead store costs one fast failure, not one per request.

closed    -> every call goes to the store; a failure opens the breaker
open      -> calls are refused at once for `cooldown` seconds (requests BYPASS the store)
half-open -> after the cooldown one call is let through; success closes, failure re-opens

Slow stores fail through their own timeouts (for Redis: `socket_timeout` in the store URL),
so the breaker adds no timer to the hit path.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class StoreUnavailable(Exception):
    """The breaker is open, or the store just failed: treat the store as absent."""


class Breaker:
    """Decides whether the store may be called, from what the last calls did."""

    def __init__(self, *, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._cooldown = cooldown
        self._clock = clock
        self._open_until = 0.0
        self._probing = False
        # Every call goes to the store (an attribute, not a property: read on every repeat HIT).
        self.closed = True

    @property
    def state(self) -> str:
        """closed, open or half-open."""
        if self._open_until == 0.0:
            return "closed"
        return "open" if self._clock() < self._open_until else "half-open"

    def allow(self) -> None:
        """Raise StoreUnavailable unless a call may go to the store now."""
        if self._open_until == 0.0:
            return
        if self._clock() < self._open_until or self._probing:
            raise StoreUnavailable("store circuit open")
        self._probing = True  # half-open: this call is the probe

    def succeeded(self) -> None:
        """The call worked: close the breaker."""
        self._open_until, self._probing, self.closed = 0.0, False, True

    def abandoned(self) -> None:
        """The call ended without a verdict (cancelled): let another call probe."""
        self._probing = False

    def failed(self) -> None:
        """The call failed: open the breaker for the cooldown."""
        self._open_until, self._probing = self._clock() + self._cooldown, False
        self.closed = False
