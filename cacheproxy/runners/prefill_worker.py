"""The prefill process itself (`prefiller.PrefillProcess` starts it as
``python -P -m cacheproxy.runners.prefill_worker FD MODEL_DIR FILES``).

It loads the model directory (the weights only: `mlx_lm.load`'s model, without a tokenizer),
says which file identities it loaded, then answers the runner's messages on the socket FD:

- ``("prefill", job, given, chunks, ids, step)``: a fresh cache, the ``chunks`` saved prefix
  chunks of file ``given`` restored into it (`prefix.restore`), ``ids`` run through the
  model in chunks of ``step`` (`prefix.prefilling`, exactly a lone generation's prefill);
  answered ``("done", name, offsets)`` with each layer's whole keys and values buffers in
  file ``name`` (the runner removes both files), ``("cancelled", job)`` if a
  ``("cancel", job)`` came before its last chunk, or ``("error", why)``;
- ``("exit",)``: it ends (the runner removes the files directory).

It ignores SIGINT and SIGTERM (a Ctrl-C or a stop sent to the server's whole group is the
server's to handle: it ends this process when it is done). When the runner's end of the
socket closes unasked (the server was killed), it removes its files directory and ends.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from cacheproxy.runners import prefix
from cacheproxy.runners.watcher import snapshot


class _Exit(Exception):
    """The runner said exit while a prefill ran."""


def save(path: Path, arrays: dict[str, Any]) -> None:
    """Arrays into a safetensors file (none left behind if the write fails)."""
    import mlx.core as mx

    try:
        mx.save_safetensors(str(path), arrays)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def load(path: Path) -> dict[str, Any]:
    """The arrays of a safetensors file, read (evaluated: the file may go right after)."""
    import mlx.core as mx

    arrays = cast(dict[str, Any], mx.load(str(path)))
    mx.eval(list(arrays.values()))
    return arrays


def serve(conn: Connection, model_dir: Path, files: Path) -> None:
    """Load, then answer the runner until it says exit or its end of the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        told = _serve(conn, model_dir, files)
    except (EOFError, OSError):
        told = False
    if not told:  # the runner is gone: tidy up for it
        shutil.rmtree(files, ignore_errors=True)
        with contextlib.suppress(OSError):
            files.parent.rmdir()  # (the last process out removes the runner's directory)


def _serve(conn: Connection, model_dir: Path, files: Path) -> bool:
    """True once the runner said exit (or learnt that the load failed)."""
    before = snapshot(model_dir)
    try:
        from mlx_lm.utils import load_model

        model = load_model(model_dir)[0]
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return True
    conn.send(("loaded", before, snapshot(model_dir)))
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "exit":
            return True
        if kind == "prefill":
            try:
                reply = _prefill(conn, model, files, *message[1:])
            except _Exit:
                return True
            except Exception as exc:  # that generation fails; the process goes on
                reply = ("error", f"{type(exc).__name__}: {exc}")
            conn.send(reply)
        elif kind != "cancel":  # (a cancel of a job already answered: nothing to do)
            conn.send(("error", f"unknown message {kind!r}"))


def _prefill(conn: Connection, model: Any, files: Path, job: int, given: str, chunks: int,
             ids: list[int], step: int) -> tuple[Any, ...]:
    """One prefill, as the lone runner's (`prefix.warming`'s restore, then its chunks)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if chunks:
        arrays = load(files / given)
        saved = [prefix.Chunk(b"", "", b"", tuple((arrays[f"{c}.{n}.k"], arrays[f"{c}.{n}.v"])
                                                  for n in range(len(cache))), 0)
                 for c in range(chunks)]
        prefix.restore(cache, saved, step)
    if not chunks and not ids:
        raise ValueError("nothing to prefill")  # (the runner never asks for it)
    for _ in prefix.prefilling(model, cache, ids, step):
        while conn.poll():
            message = conn.recv()
            if message[0] == "exit":
                raise _Exit
            if message[0] == "cancel" and message[1] == job:
                return ("cancelled", job)
    # Whole buffers (contiguous: saved without a copy; the runner's cache is then laid out
    # as this one, zeros past the end included, with nothing to pad).
    name = f"out-{job}.safetensors"
    save(files / name, {f"{n}.{kv}": a for n, layer in enumerate(cache)
                        for kv, a in (("k", layer.keys), ("v", layer.values))})
    return ("done", name, [layer.offset for layer in cache])


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), Path(sys.argv[2]), Path(sys.argv[3]))
