"""Whether anyone takes a generation's chunks as they come (a streaming client), and whom to
tell when someone starts. A producer may gather its output while nobody does."""

from __future__ import annotations

from collections.abc import Callable


class Live:
    """Off until a reader takes the chunks as they come (or a cancel needs the next token
    seen); then on for good."""

    __slots__ = ("on", "_calls")

    def __init__(self) -> None:
        self.on = False
        self._calls: list[Callable[[], None]] = []

    def start(self) -> None:
        """Someone reads live from now on: call every listener, once (they must not raise)."""
        if not self.on:
            self.on = True
            calls, self._calls = self._calls, []
            for call in calls:
                call()

    def when(self, call: Callable[[], None]) -> None:
        """Call `call` once someone reads live: now, if someone already does."""
        if self.on:
            call()
        else:
            self._calls.append(call)

    def forget(self, call: Callable[[], None]) -> None:
        """No longer call `call` (a listener that finished)."""
        if call in self._calls:
            self._calls.remove(call)
