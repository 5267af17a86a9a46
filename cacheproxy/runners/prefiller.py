"""The prefill process of `--decode-slots S > 1`: prompts are prefilled in a process of their
own (`prefill_worker`), beside the decode steps of the lane, so a prefill never slows the
batch down.

Why a process and not a thread: MLX throttles evaluation on a process-wide count of tasks in
flight (``MAX_ACTIVE_TASKS``, no setting), and on the CPU every op is a task. A prefill keeps
that many long matrix products in flight, so a decode step's hundreds of small tasks beside
it go in one at a time: measured on a 2-core machine (Llama 1024x8, 8 rows, OpenBLAS on one
thread), a decode step took 114 ms alone, 271 ms beside a prefill thread and 130 ms beside a
prefill process. Two processes have two schedulers.

The process loads the same model directory (its file identities must be those the runner
loaded, else it is refused and the watcher reloads both) and runs exactly the prefill a lone
generation runs, from the saved prefix chunks it is handed; it hands back each layer's whole
keys and values buffers, which the runner's cache takes as they are: the same bits, the same
layout. Messages cross a socket pair; arrays cross as safetensors files (any dtype) in a
private directory, in memory (/dev/shm) where it has room. One process per loaded model: a
reload starts a new one and ends the old once the new model serves. A process that ends (killed,
out of memory) is started again by the next prefill; the prefill it ended in runs once more
(a pure function), and fails if it ends again. Every failure reaches the request as a 500
`generation_failed` with a plain message; the server log says why (`prefill_process_failed`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import structlog

from cacheproxy.errors import GenerationFailed
from cacheproxy.runners import prefix
from cacheproxy.runners.prefill_worker import load, save
from cacheproxy.runners.watcher import Snapshot

WORKER = "cacheproxy.runners.prefill_worker"
POLL = 0.02  # seconds between two looks at a waiting generation's cancellation
CANCEL_WAIT = 10.0  # seconds a cancelled prefill may take to stop before its process is killed
EXIT_WAIT = 5.0  # seconds a closing process has to end before it is killed
SHM = "/dev/shm"
PREFIX = "cacheproxy-prefill-"  # then the server's pid: a dead server's directory is swept
SHM_MIN_FREE = 1 << 30  # below this free in /dev/shm (Docker gives 64 MB), a disk directory

log = structlog.get_logger("cacheproxy.runners")


class PrefillProcessError(GenerationFailed):
    """The prefill process failed to load, failed a prefill, or is gone (``detail`` says
    which; the request sees a plain message)."""

    def __init__(self, detail: str) -> None:
        super().__init__("generation failed: the prefill process failed (the server log "
                         "says why)")
        self.detail = detail


class Gone(PrefillProcessError):
    """The prefill process ended (its end of the socket closed)."""


class ModelFilesMoved(PrefillProcessError):
    """The prefill process loaded other files than the runner (they changed meanwhile)."""


def _failed(error: PrefillProcessError, model: Path) -> PrefillProcessError:
    log.warning("prefill_process_failed", detail=error.detail, model=str(model))
    return error


class PrefillProcess:
    """A process that holds the model and prefills prompts for the lane (see the module)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # one prefill at a time (the lane has one prefiller)
        self._jobs = itertools.count(1)
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._expected: Snapshot | None = None  # the runner's files (set by wait_loaded)
        self._loaded = False  # this process said it loaded them
        self._stale = ""  # why no prefill may run any more (the files changed): until a reload
        self._closed = False
        self.restarts = 0  # processes started again after one ended (the lane shows it)
        root = _files_root()
        sweep(Path(root or tempfile.gettempdir()))
        self._dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
        self._files = self._dir
        try:
            self._start()
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    @property
    def pid(self) -> int | None:
        """The process's id (a new one after a restart)."""
        return self._process.pid if self._process is not None else None

    def _start(self) -> None:
        # A fresh interpreter (-P: `cacheproxy` from where this one came, not the working
        # directory), not multiprocessing's spawn (which runs the parent's main script again
        # in the child) nor fork (unsafe beside threads and MLX). It inherits the
        # environment: the BLAS and its thread count, so the same bits.
        self._files = self._dir / str(self.restarts)  # its own (it tidies up if orphaned)
        self._files.mkdir()
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-P", "-m", WORKER, str(theirs.fileno()), str(self.path),
                 str(self._files)], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())

    def wait_loaded(self, expected: Snapshot) -> None:
        """Wait for the process's load; refuse (`ModelFilesMoved`) a load of other files
        than ``expected``, the runner's."""
        self._expected = expected
        try:
            reply = self._receive()
        except Gone as exc:
            raise _failed(exc, self.path) from None
        if reply[0] != "loaded":
            raise _failed(PrefillProcessError(f"it could not load the model: {reply[1]}"),
                          self.path)
        if reply[1] != expected or reply[2] != expected:
            raise _failed(ModelFilesMoved(f"the files of {self.path} changed while the "
                                          "prefill process loaded them"), self.path)
        self._loaded = True

    def prefill(self, chunks: Sequence[prefix.Chunk], ids: Sequence[int], step: int,
                cancelled: Callable[[], bool]) -> tuple[Any, ...] | None:
        """Each layer's (keys, values, offset) after a prefill of ``ids`` in chunks of
        ``step`` from the state of ``chunks`` (saved prefix chunks, maybe none); None if
        ``cancelled()`` became true first. Run once more in a new process if its process
        ends meanwhile."""
        with self._lock:
            if self._closed or self._stale:
                raise _failed(PrefillProcessError(self._stale or "it was closed"), self.path)
            job = next(self._jobs)
            try:
                reply = self._attempt(job, chunks, ids, step, cancelled)
            except Gone as first:
                log.warning("prefill_process_ended", detail=first.detail, model=str(self.path))
                try:
                    reply = self._attempt(job, chunks, ids, step, cancelled)
                except Gone as second:
                    raise _failed(second, self.path) from None
            if reply[0] == "cancelled":
                return None
            if reply[0] != "done":
                raise _failed(PrefillProcessError(f"a prefill failed: {reply[1]}"), self.path)
            out = self._files / reply[1]
            try:
                arrays = load(out)
            finally:
                out.unlink(missing_ok=True)
        return tuple((arrays[f"{n}.k"], arrays[f"{n}.v"], offset)
                     for n, offset in enumerate(reply[2]))

    def _attempt(self, job: int, chunks: Sequence[prefix.Chunk], ids: Sequence[int],
                 step: int, cancelled: Callable[[], bool]) -> tuple[Any, ...]:
        if not self._alive():
            self._restart()
        given = self._files / f"in-{job}.safetensors"
        try:
            if chunks:
                save(given, {f"{c}.{n}.{kv}": a for c, chunk in enumerate(chunks)
                             for n, layer in enumerate(chunk.layers)
                             for kv, a in zip("kv", layer, strict=True)})
            self._send(("prefill", job, given.name, len(chunks), list(ids), step))
            return self._wait(job, cancelled)
        finally:
            given.unlink(missing_ok=True)

    def _wait(self, job: int, cancelled: Callable[[], bool]) -> tuple[Any, ...]:
        """Its reply; a cancelled job the process does not stop within CANCEL_WAIT (stuck)
        is ended with its process, which the next prefill starts again."""
        asked = 0.0
        while True:
            if not asked and cancelled():
                self._send(("cancel", job))
                asked = time.monotonic()
            if self._poll():
                return self._receive()
            if asked and time.monotonic() - asked > CANCEL_WAIT:
                log.warning("prefill_process_unresponsive", model=str(self.path))
                self._end()
                return ("cancelled", job)

    def close(self) -> None:
        """End the process (one still loading, or refused, is killed: nothing of it is
        wanted) and remove its files."""
        self._closed = True
        if self._process is not None and not self._loaded:
            self._process.kill()
        if self._conn is not None:
            with contextlib.suppress(OSError):  # (it may be gone already)
                self._conn.send(("exit",))
        self._end(wait=EXIT_WAIT)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _end(self, wait: float = 0.0) -> None:
        """Close the socket; the process ends (on its own within ``wait``, else killed)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            try:
                self._process.wait(wait)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _alive(self) -> bool:
        """Whether the process is there to take a prefill (it never writes unasked: a socket
        that reads before a request is one whose other end closed)."""
        if not self._loaded or self._process is None or self._conn is None or \
                self._process.poll() is not None:
            return False  # (one refused at its load is replaced too: it is checked again)
        try:
            return not self._conn.poll(0)
        except OSError:
            return False

    def _restart(self) -> None:
        """A new process in place of one that ended (it must load the runner's files)."""
        if self._expected is None:
            raise _failed(PrefillProcessError("it was never loaded"), self.path)
        self._end()  # (killed and reaped, if it had not quite ended)
        self.restarts += 1
        self._loaded = False
        self._start()
        try:
            self.wait_loaded(self._expected)
        except ModelFilesMoved:
            self._stale = ("the model's files changed since the runner loaded them; no "
                           "prefill runs until the reload that serves them")
            self._end()
            raise
        except PrefillProcessError:
            self._end()
            raise

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._connection().send(message)
        except OSError as exc:
            raise self._gone() from exc

    def _poll(self) -> bool:
        try:
            return self._connection().poll(POLL)
        except OSError as exc:
            raise self._gone() from exc

    def _receive(self) -> tuple[Any, ...]:
        try:
            return tuple(self._connection().recv())
        except (EOFError, OSError) as exc:
            raise self._gone() from exc

    def _connection(self) -> Connection:
        if self._conn is None:  # (ended: by `_end`, after a stuck cancel or a failed restart)
            raise self._gone()
        return self._conn

    def _gone(self) -> Gone:
        code = None
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._process.wait(1.0)
        return Gone(f"the prefill process ended (exit code {code})")


def sweep(root: Path) -> None:
    """Remove the files directories of servers that are gone (killed with their prefill
    process, as a process group's SIGKILL does: neither could tidy up)."""
    for path in root.glob(f"{PREFIX}*-*"):
        pid = path.name.removeprefix(PREFIX).split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # (another user's live process)


def _files_root() -> str | None:
    """/dev/shm where it is a writable directory with room, else the usual temporary one."""
    try:
        free = os.statvfs(SHM)
    except OSError:
        return None
    roomy = free.f_bavail * free.f_frsize >= SHM_MIN_FREE
    return SHM if roomy and os.access(SHM, os.W_OK | os.X_OK) else None
