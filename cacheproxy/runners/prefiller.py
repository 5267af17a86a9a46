"""The prefill process of `--decode-slots S > 1`: prompts are prefilled in a process of their
own, beside the decode steps of the lane, so a prefill never slows the batch down.

Why a process and not a thread: MLX throttles evaluation on a process-wide count of tasks in
flight (``MAX_ACTIVE_TASKS``, no setting), and on the CPU every op is a task. A prefill keeps
that many long matrix products in flight, so a decode step's hundreds of small tasks beside
it go in one at a time: measured on a 2-core machine (Llama 1024x8, 8 rows, OpenBLAS on one
thread), a decode step took 114 ms alone, 271 ms beside a prefill thread and 130 ms beside a
prefill process. Two processes have two schedulers.

The process loads the same model directory (its file identities must be those the runner
loaded: a changed file is refused, the watcher reloads both) and runs exactly the prefill a
lone generation runs (`prefix.prefilling`: chunks of the pinned step, an evaluation after
each), from the saved prefix chunks it is handed. It hands back each layer's keys and values
as the cache held them (its whole buffers, zeros past the end included): the same bits, the
same layout. Messages cross a socket pair; arrays cross as safetensors files (any dtype) in
a private directory in memory (/dev/shm where there is one), each removed once read (the
directory by the runner when it closes, or by the process when the runner's end of the
socket closes unasked). One process per loaded model: a reload starts a new one and ends
the old once the new model serves.
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
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import structlog

from cacheproxy.runners import prefix
from cacheproxy.runners.watcher import Snapshot, snapshot

POLL = 0.02  # seconds between two looks at a waiting generation's cancellation
EXIT_WAIT = 5.0  # seconds a closing process has to end before it is killed

log = structlog.get_logger("cacheproxy.runners")


class PrefillProcessError(RuntimeError):
    """The prefill process failed to load, failed a prefill, or is gone."""


class PrefillProcess:
    """A process that holds the model and prefills prompts for the lane (see the module)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # one prefill at a time (the lane has one prefiller)
        self._jobs = itertools.count(1)
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._expected: Snapshot | None = None
        self.restarts = 0  # processes started again after one ended (the lane shows it)
        # The arrays cross in files of a private directory in memory where there is one
        # (/dev/shm): ~5x faster than through the socket for a long prompt's state.
        self._dir = Path(tempfile.mkdtemp(prefix="cacheproxy-prefill-", dir=_memory_dir()))
        self._start()

    def _start(self) -> None:
        # A fresh interpreter running this module, not multiprocessing's spawn (which runs
        # the parent's main script again in the child: a program without a main guard would
        # start itself) nor fork (unsafe beside threads and MLX). It inherits the
        # environment (the BLAS, its thread count) and talks over one end of a socket pair.
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # (where `cacheproxy` imports from)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "cacheproxy.runners.prefiller", str(theirs.fileno()),
                 str(self.path), str(self._dir)], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())

    @property
    def pid(self) -> int | None:
        """The process's id (a new one after a restart)."""
        return self._process.pid if self._process is not None else None

    def wait_loaded(self, expected: Snapshot) -> None:
        """Wait for the process's load; refuse (`ModelFilesMoved`) a load of other files
        than ``expected``, the runner's."""
        self._expected = expected
        reply = self._receive()
        if reply[0] != "loaded":
            raise PrefillProcessError(f"the prefill process could not load the model: {reply[1]}")
        if reply[1] != expected or reply[2] != expected:
            raise ModelFilesMoved(f"the files of {self.path} changed while the prefill "
                                  "process loaded them")

    def prefill(self, chunks: Sequence[prefix.Chunk], ids: Sequence[int], step: int,
                cancelled: Callable[[], bool]) -> tuple[Any, ...] | None:
        """Each layer's (keys, values, offset) after a prefill of ``ids`` in chunks of
        ``step`` from the state of ``chunks`` (saved prefix chunks, maybe none); None if
        ``cancelled()`` became true first. A process that ends during it (killed, out of
        memory) is started again and the prefill run once more (it is a pure function);
        a second end fails it."""
        with self._lock:
            job = next(self._jobs)
            given = self._dir / f"in-{job}.safetensors"
            try:
                if chunks:
                    _save(given, {f"{c}.{n}.{kv}": a for c, chunk in enumerate(chunks)
                                  for n, layer in enumerate(chunk.layers)
                                  for kv, a in zip("kv", layer, strict=True)})
                message = ("prefill", job, given.name, len(chunks), list(ids), step)
                try:
                    reply = self._run(message, cancelled)
                except Gone:
                    reply = self._run(message, cancelled)
            finally:
                given.unlink(missing_ok=True)
        if reply[0] == "cancelled":
            return None
        if reply[0] != "done":
            raise PrefillProcessError(f"the prefill process failed: {reply[1]}")
        return _layers(self._dir / reply[1], reply[2])

    def _run(self, message: tuple[Any, ...], cancelled: Callable[[], bool]
             ) -> tuple[Any, ...]:
        if not self._alive():
            self._restart()
        self._send(message)
        asked = False
        while not self._poll():
            if not asked and cancelled():
                self._send(("cancel", message[1]))
                asked = True
        return self._receive()

    def close(self) -> None:
        """End the process (a prefill in progress ends with it)."""
        if self._conn is not None:
            with contextlib.suppress(OSError):  # (it may be gone already)
                self._conn.send(("exit",))
            self._conn.close()
            self._conn = None
        if self._process is not None:
            try:
                self._process.wait(EXIT_WAIT)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _alive(self) -> bool:
        """Whether the process is there to take a prefill (it never writes unasked: a pipe
        that reads before a request is one whose other end closed)."""
        if self._process is None or self._conn is None or self._process.poll() is not None:
            return False
        try:
            return not self._conn.poll(0)
        except OSError:
            return False

    def _restart(self) -> None:
        """A new process after the last one ended (it must load the same files)."""
        exitcode = self._process.poll() if self._process is not None else None
        if self._conn is not None:
            self._conn.close()
        self.restarts += 1
        self._start()
        if self._expected is None:
            raise PrefillProcessError("the prefill process was never loaded")
        try:
            self.wait_loaded(self._expected)
        except ModelFilesMoved as exc:
            raise PrefillProcessError(f"the prefill process ended (exit code {exitcode}) and "
                                      "the model's files changed since they were loaded; "
                                      "the next reload serves them") from exc

    def _send(self, message: tuple[Any, ...]) -> None:
        assert self._conn is not None
        try:
            self._conn.send(message)
        except OSError as exc:
            raise self._gone() from exc

    def _poll(self) -> bool:
        assert self._conn is not None
        try:
            return self._conn.poll(POLL)
        except OSError as exc:
            raise self._gone() from exc

    def _receive(self) -> tuple[Any, ...]:
        assert self._conn is not None
        try:
            return tuple(self._conn.recv())
        except (EOFError, OSError) as exc:
            raise self._gone() from exc

    def _gone(self) -> Gone:
        exitcode = None
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                exitcode = self._process.wait(1.0)
        log.warning("prefill_process_ended", exitcode=exitcode, model=str(self.path))
        return Gone(f"the prefill process ended (exit code {exitcode}); the next prefill "
                    "starts another")


class Gone(PrefillProcessError):
    """The prefill process ended (its pipe closed)."""


class ModelFilesMoved(PrefillProcessError):
    """The prefill process loaded other files than the runner (they changed meanwhile)."""


class _Exit(Exception):
    """The runner said exit while a prefill ran."""


def _memory_dir() -> str | None:
    """/dev/shm where it is a writable directory (Linux), else the usual temporary one."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _save(path: Path, arrays: dict[str, Any]) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(path), arrays)


def _load(path: Path) -> dict[str, Any]:
    """The arrays of a file, evaluated (read), and the file removed."""
    import mlx.core as mx

    try:
        arrays = cast(dict[str, Any], mx.load(str(path)))
        mx.eval(list(arrays.values()))
        return arrays
    finally:
        path.unlink(missing_ok=True)


def _layers(path: Path, offsets: Sequence[int]) -> tuple[Any, ...]:
    """Each layer's (keys, values, offset): the buffers the prefill process's cache held,
    zeros past the end included."""
    arrays = _load(path)
    return tuple((arrays[f"{n}.k"], arrays[f"{n}.v"], offset)
                 for n, offset in enumerate(offsets))


def serve(conn: Connection, path: str, files: Path) -> None:
    """The prefill process: load the model, then prefill what the runner sends (arrays in
    ``files``) until it says exit or its end of the socket closes (the runner ended)."""
    before = snapshot(Path(path))
    try:
        from mlx_lm import load

        model = load(path)[0]
    except Exception as exc:  # the runner's load reports its own error; this says why here
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("loaded", before, snapshot(Path(path))))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the runner's process ended (killed?): tidy up for it
            shutil.rmtree(files, ignore_errors=True)
            return
        if message[0] == "exit":
            return
        if message[0] == "prefill":
            try:
                conn.send(_prefill(conn, model, files, *message[1:]))
            except _Exit:
                return
            except Exception as exc:  # the generation fails with it; the process goes on
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        # (a "cancel" of a job already answered: nothing to do)


def _prefill(conn: Connection, model: Any, files: Path, job: int, given: str, chunks: int,
             ids: list[int], step: int) -> tuple[Any, ...]:
    """One prefill, as the lone runner's (`prefix.warming`'s restore, then its chunks)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if chunks:
        arrays = _load(files / given)
        saved = [prefix.Chunk(b"", "", b"", tuple((arrays[f"{c}.{n}.k"], arrays[f"{c}.{n}.v"])
                                                  for n in range(len(cache))), 0)
                 for c in range(chunks)]
        prefix.restore(cache, saved, step)
    for _ in prefix.prefilling(model, cache, ids, step):
        while conn.poll():
            message = conn.recv()
            if message[0] == "exit":
                raise _Exit
            if message[0] == "cancel" and message[1] == job:
                return ("cancelled", job)
    if not chunks and not ids:
        raise ValueError("nothing to prefill")  # (the runner restores or skips such a state)
    # Whole buffers (contiguous: saved without a copy; the runner's cache is then laid out
    # as this one, zeros past the end included, with nothing to pad).
    arrays = {f"{n}.{kv}": a for n, layer in enumerate(cache)
              for kv, a in (("k", layer.keys), ("v", layer.values))}
    offsets = [layer.offset for layer in cache]
    name = f"out-{job}.safetensors"
    _save(files / name, arrays)
    return ("done", name, offsets)


if __name__ == "__main__":  # the prefill process: `python -m cacheproxy.runners.prefiller`
    serve(Connection(int(sys.argv[1])), sys.argv[2], Path(sys.argv[3]))  # FD MODEL FILES
