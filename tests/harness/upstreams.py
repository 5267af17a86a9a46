"""Real `python -m mlx_lm.server` processes for tests, and a recording relay to put in
front of one (to see what it was sent, or to play a misbehaving upstream).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tests.harness.processes import Procs, health_probe, wait_ready

_START_TIMEOUT_S = 60.0
_FINGERPRINT = re.compile(rb'"system_fingerprint": ?"[^"]*"')


class Upstream:
    """One mlx_lm.server serving a model directory on a fixed port; restartable (through
    the tests' one launcher, tests/harness/processes.py)."""

    def __init__(self, model_dir: Path, port: int, log: Path) -> None:
        self.model_dir, self.port, self.log = model_dir, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._procs = Procs()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Spawn the server (returns at once; `wait_ready` waits for it)."""
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--prompt-cache-size", "0"]  # every prefill cold, as the README says
        self._proc = self._procs.start("mlx_lm.server", argv, self.log, None,
                                       {**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait_ready(self) -> None:
        """Until /health answers (the model is loaded at its first request)."""
        if self._proc is None:
            raise RuntimeError("mlx_lm.server was not started")
        wait_ready(self._proc, health_probe(self.url), self.log, "mlx_lm.server",
                   _START_TIMEOUT_S)

    def kill(self) -> None:
        """Kill the process (SIGKILL: no goodbye to its clients) and reap it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None


@dataclass
class Relay:
    """An HTTP relay in front of an upstream that records every POST body.

    `fingerprint` rewrites the system_fingerprint of every answer (an upstream of another
    engine version, without installing one); `stall` delays answers, `stall_midway` pauses
    a stream after its first event (and sets `midway`); `reject` answers with (status,
    body) instead of forwarding; `inject` merges fields into every forwarded POST body
    (tools the client never offered). Fakes, each used where a real mlx_lm.server cannot be
    made to behave that way. `relayed` counts the events each stream passed on before it ended
    or its reader hung up.
    """

    target: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    fingerprint: str | None = None
    stall: float = 0.0
    stall_midway: float = 0.0
    reject: tuple[int, dict[str, Any]] | None = None
    inject: dict[str, Any] | None = None
    url: str = ""
    relayed: list[int] = field(default_factory=list)
    midway: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def generations(self) -> list[dict[str, Any]]:
        """The streamed requests (fills), without probes and prompt-token look-ups."""
        return [b for b in self.bodies if b.get("stream")]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Forward one request, line by line, so streams stay streams."""
        body = await request.read()
        if request.method == "POST":
            self.bodies.append(orjson.loads(body))
            if self.inject:
                body = orjson.dumps({**orjson.loads(body), **self.inject})
        if self.stall and request.method == "POST":
            await asyncio.sleep(self.stall)
        if self.reject is not None and request.method == "POST":
            status, error = self.reject
            return web.json_response(error, status=status)
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session, session.request(
            request.method, self.target + request.path_qs, data=body or None,
            headers={"Content-Type": "application/json"},
        ) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            paused, events = False, 0
            try:
                async for line in upstream.content:
                    await response.write(self._rewritten(line))
                    events += line.startswith(b"data: {")
                    if self.stall_midway and not paused and line.startswith(b"data: {"):
                        paused = True
                        self.midway.set()
                        await asyncio.sleep(self.stall_midway)
                await response.write_eof()
            finally:
                if upstream.content_type == "text/event-stream":
                    self.relayed.append(events)
            return response

    def _rewritten(self, line: bytes) -> bytes:
        if self.fingerprint is None:
            return line
        return _FINGERPRINT.sub(b'"system_fingerprint": "' + self.fingerprint.encode() + b'"',
                                line)
