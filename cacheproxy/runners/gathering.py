"""Letting the kernel gather a socket's input: the receive low-water mark (SO_RCVLOWAT).

With the mark raised, Linux reports a TCP socket readable only once that many bytes wait,
or the peer closed, or memory runs short: the upstream reader, while nobody reads a
generation live, wakes once per GATHER bytes or at the upstream's close instead of once per
token. Lowering the mark again wakes a waiting loop at once (Linux 4.18 and later) with what
the kernel holds. Elsewhere nothing is gathered (on macOS, kqueue would look again only at
the next arrival, a token late).
"""

from __future__ import annotations

import asyncio
import socket
import sys

if sys.platform == "linux":  # fcntl and termios do not exist everywhere (Windows)
    import fcntl
    import termios

GATHER = 64 * 1024  # bytes per wake-up: about 190 events of mlx_lm.server
SUPPORTED = sys.platform == "linux"


class LowWater:
    """The receive low-water mark of one connected transport's socket, and what waits in it."""

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._sock = transport.get_extra_info("socket")

    def set(self, size: int) -> bool:
        """Wake the reader once `size` bytes wait (1: at every arrival); False if not done."""
        if self._sock is None:
            return False
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, size)
        except (OSError, ValueError):  # closed meanwhile, or no such option: read per token
            return False
        return True

    def waiting(self) -> int | None:
        """Bytes received and not read yet; None if the socket cannot tell (closed, say)."""
        if sys.platform == "linux" and self._sock is not None:
            try:
                raw = fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, bytes(4))
            except (OSError, ValueError):
                return None
            return int.from_bytes(raw, sys.byteorder)
        return None
