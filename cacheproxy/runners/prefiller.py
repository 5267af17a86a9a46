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
up to the prompt's end and the size of the buffer they were in, and the runner lays them out
as the cache held them (zeros past the end): the same bits, the same layout. Arrays cross
the pipe as safetensors (any dtype, no pickle of arrays). One process per loaded model: a
reload starts a new one and ends the old once the new model serves.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

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
        self._process: Any = None
        self._expected: Snapshot | None = None
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # (fork is unsafe beside threads and MLX)
        ours, theirs = ctx.Pipe()
        self._process = ctx.Process(target=serve, args=(theirs, str(self.path)),
                                    name="cacheproxy-prefill", daemon=True)
        self._process.start()
        theirs.close()
        self._conn = ours

    @property
    def pid(self) -> int | None:
        """The process's id (a new one after a restart)."""
        return int(self._process.pid) if self._process is not None else None

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
        blob = _pack({f"{c}.{n}.{kv}": a for c, chunk in enumerate(chunks)
                      for n, layer in enumerate(chunk.layers)
                      for kv, a in zip("kv", layer, strict=True)})
        with self._lock:
            try:
                reply = self._run(("prefill", next(self._jobs), blob, len(chunks), list(ids),
                                   step), cancelled)
            except Gone:
                reply = self._run(("prefill", next(self._jobs), blob, len(chunks), list(ids),
                                   step), cancelled)
        if reply[0] == "cancelled":
            return None
        if reply[0] != "done":
            raise PrefillProcessError(f"the prefill process failed: {reply[1]}")
        return _layers(reply[1], reply[2])

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
            self._process.join(EXIT_WAIT)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    def _alive(self) -> bool:
        """Whether the process is there to take a prefill (it never writes unasked: a pipe
        that reads before a request is one whose other end closed)."""
        if self._process is None or self._conn is None or not self._process.is_alive():
            return False
        try:
            return not self._conn.poll(0)
        except OSError:
            return False

    def _restart(self) -> None:
        """A new process after the last one ended (it must load the same files)."""
        exitcode = self._process.exitcode if self._process is not None else None
        if self._conn is not None:
            self._conn.close()
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
        self._process.join(1.0)
        log.warning("prefill_process_ended", exitcode=self._process.exitcode,
                    model=str(self.path))
        return Gone(f"the prefill process ended (exit code "
                                   f"{self._process.exitcode}); the next prefill starts another")


class Gone(PrefillProcessError):
    """The prefill process ended (its pipe closed)."""


class ModelFilesMoved(PrefillProcessError):
    """The prefill process loaded other files than the runner (they changed meanwhile)."""


class _Exit(Exception):
    """The runner said exit while a prefill ran."""


def _pack(arrays: dict[str, Any]) -> bytes:
    import mlx.core as mx

    out = io.BytesIO()
    mx.save_safetensors(out, arrays)
    return out.getvalue()


def _unpack(blob: bytes) -> dict[str, Any]:
    import mlx.core as mx

    arrays = mx.load(io.BytesIO(blob), format="safetensors")
    return arrays if isinstance(arrays, dict) else {}


def _layers(blob: bytes, sizes: Sequence[tuple[int, int]]) -> tuple[Any, ...]:
    """Each layer's (keys, values, offset) laid out in a buffer of its size, zeros past the
    end, as the prefill process's cache held them."""
    import mlx.core as mx

    arrays = _unpack(blob)
    out = []
    for n, (offset, size) in enumerate(sizes):
        keys, values = arrays[f"{n}.k"], arrays[f"{n}.v"]
        if size > offset:
            keys = mx.concatenate([keys, mx.zeros((*keys.shape[:2], size - offset,
                                                   keys.shape[3]), keys.dtype)], axis=2)
            values = mx.concatenate([values, mx.zeros((*values.shape[:2], size - offset,
                                                       values.shape[3]), values.dtype)], axis=2)
        out.append((keys, values, offset))
    mx.eval([kv for layer in out for kv in layer[:2]])
    return tuple(out)


def serve(conn: Connection, path: str) -> None:
    """The prefill process: load the model, then prefill what the runner sends until it
    says exit or its end of the pipe closes (the runner's process ended)."""
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
        except (EOFError, OSError):
            return
        if message[0] == "exit":
            return
        if message[0] == "prefill":
            try:
                conn.send(_prefill(conn, model, *message[1:]))
            except _Exit:
                return
            except Exception as exc:  # the generation fails with it; the process goes on
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        # (a "cancel" of a job already answered: nothing to do)


def _prefill(conn: Connection, model: Any, job: int, blob: bytes, chunks: int,
             ids: list[int], step: int) -> tuple[Any, ...]:
    """One prefill, as the lone runner's (`prefix.warming`'s restore, then its chunks)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if chunks:
        arrays = _unpack(blob)
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
        return ("done", _pack({}), [])
    arrays = {}
    for n, layer in enumerate(cache):
        arrays[f"{n}.k"] = layer.keys[..., :layer.offset, :]
        arrays[f"{n}.v"] = layer.values[..., :layer.offset, :]
    sizes = [(layer.offset, layer.keys.shape[2]) for layer in cache]
    mx.eval(list(arrays.values()))
    return ("done", _pack(arrays), sizes)
