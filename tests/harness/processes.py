"""The one process launcher of the tests and the load tests: children in sessions of their
own (optionally pinned to a core), their output in a log file, started until a probe says
they are ready, stopped with SIGTERM (then SIGKILL) when their group closes.

`serving` and `replicas` are what the tests use: `cacheproxy serve` processes on free ports
(another port if the one picked was taken before the child bound it), healthy before the
block runs, whose clean exit on SIGTERM is asserted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
CLI = [sys.executable, "-m", "cacheproxy"]
# Debian's OpenBLAS: the batch-variant runtime the exactness tests run their children under.
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 5.0
Probe = Callable[[], bool]


class HarnessError(RuntimeError):
    """Something a test or a load test cannot go on without: a child that exited or never
    became ready (its log's tail in the message), a tool that is missing."""


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def openblas_env() -> dict[str, str]:
    """This process's environment with OpenBLAS preloaded (offline); fails the test without it."""
    if not OPENBLAS.exists():
        import pytest

        pytest.fail(f"{OPENBLAS} is missing: `apt-get install libopenblas0-pthread` "
                    "(.ci/run installs it)")
    return {**os.environ, "LD_PRELOAD": str(OPENBLAS), "HF_HUB_OFFLINE": "1"}


def pinned(argv: Sequence[str], core: int | None) -> list[str]:
    """argv run on one core (taskset), or as is."""
    if core is None:
        return list(argv)
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(core), *argv] if taskset else list(argv)


def http(method: str, url: str, body: bytes | None = None, timeout: float = 30.0
         ) -> tuple[int, dict[str, str], bytes]:
    """One request: (status, headers, body); an HTTP error status is an answer too."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers.items()), exc.read()


def health_probe(url: str) -> Probe:
    """Ready once GET /health answers 200."""
    return lambda: http("GET", url + "/health", timeout=2)[0] == 200


def wait_ready(proc: subprocess.Popen[bytes], probe: Probe, log: Path, what: str,
               timeout: float = START_TIMEOUT_S) -> None:
    """Until probe() holds; HarnessError if the child exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise HarnessError(f"{what} exited with {proc.returncode} before it was ready:\n"
                              f"{tail}")
        with contextlib.suppress(OSError):
            if probe():
                return
        time.sleep(0.1)
    raise HarnessError(f"{what} was not ready within {timeout:g} s (log: {log})")


@dataclass
class Child:
    """A started child: its name, base URL, process, log file and how to start it again."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    core: int | None
    probe: Probe
    env: Mapping[str, str] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process group and reap the process."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, and its exit status (SIGKILL, and an error, if it does not exit)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise HarnessError(f"{self.name} did not exit within {timeout:g} s of SIGTERM:\n"
                                  f"{self.output()[-3000:]}") from None
        return self.proc.returncode


class Procs:
    """Child processes, each in its own session; all stopped on close()."""

    def __init__(self) -> None:
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def start(self, name: str, argv: Sequence[str], log: Path, core: int | None,
              env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        preexec = None
        if core is not None and not shutil.which("taskset"):
            def preexec() -> None:  # no taskset: pin the child ourselves
                os.sched_setaffinity(0, {core})
        with log.open("wb") as out:  # (a restart starts its log anew)
            proc = subprocess.Popen(pinned(argv, core), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=preexec, env=env)
        self.children.append((name, proc))
        return proc

    def launch(self, name: str, argv: Sequence[str], url: str, log: Path, probe: Probe, *,
               core: int | None = None, env: Mapping[str, str] | None = None,
               timeout: float = START_TIMEOUT_S) -> Child:
        """Start a child and wait until probe() holds."""
        proc = self.start(name, argv, log, core, env)
        wait_ready(proc, probe, log, name, timeout)
        return Child(name, url, proc, log, list(argv), core, probe, env)

    def restart(self, child: Child) -> Child:
        """The same command again (same port, same log) after it was killed."""
        child.kill()
        return self.launch(child.name, child.argv, child.url, child.log, child.probe,
                           core=child.core, env=child.env)

    def close(self) -> None:
        for _, proc in self.children:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for _, proc in self.children:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_TIMEOUT_S)
        self.children.clear()


def start_serve(procs: Procs, log: Path, *args: str,
                env: Mapping[str, str] | None = None) -> Child:
    """`cacheproxy serve ARGS` on a free port, healthy."""
    return _on_a_free_port(lambda url: procs.launch(
        "serve", [*CLI, "serve", "--port", url.rsplit(":", 1)[1], *args], url, log,
        health_probe(url), env=env, timeout=60))


def _on_a_free_port(start: Callable[[str], Child], attempts: int = 3) -> Child:
    """start(url) on a free port; again on another if the port was taken between the pick
    and the child's bind (another test's connection, on another xdist worker)."""
    for attempt in range(attempts):
        try:
            return start(f"http://{HOST}:{free_port()}")
        except HarnessError as exc:
            if "address already in use" not in str(exc).lower() or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@contextmanager
def serving(*args: str, env: Mapping[str, str] | None = None,
            output: list[str] | None = None) -> Iterator[str]:
    """`cacheproxy serve ARGS` until the block ends, then SIGTERM: a clean exit (0) is
    asserted; its output is appended to `output` once it exited."""
    with tempfile.TemporaryDirectory(prefix="serve-") as tmp, Procs() as procs:
        child = start_serve(procs, Path(tmp) / "serve.log", *args, env=env)
        try:
            yield child.url
        finally:
            code = child.stop()
            if output is not None:
                output.append(child.output())
        assert code == 0, f"serve did not exit cleanly ({code}):\n{child.output()[-3000:]}"


@contextmanager
def replicas(store: str, count: int, *extra: str) -> Iterator[list[Child]]:
    """`count` serve processes on one store (started together, then waited for); each
    stopped at the end, its clean exit asserted (unless it was killed on purpose)."""
    with tempfile.TemporaryDirectory(prefix="replicas-") as tmp, Procs() as procs:
        started = []
        for i in range(count):
            url = f"http://{HOST}:{free_port()}"
            argv = [*CLI, "serve", "--port", url.rsplit(":", 1)[1], "--store", store,
                    "--no-watch", *extra]
            log = Path(tmp) / f"replica-{i}.log"
            proc = procs.start(f"replica-{i}", argv, log, None)
            started.append(Child(f"replica-{i}", url, proc, log, argv, None, health_probe(url)))
        for child in started:
            wait_ready(child.proc, child.probe, child.log, child.name, 60)
        yield started
        running = [child for child in started if child.proc.poll() is None]
        codes = {child.name: child.stop() for child in running}
        assert set(codes.values()) <= {0}, f"replicas did not exit cleanly: {codes}"
