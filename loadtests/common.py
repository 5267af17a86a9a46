"""Shared machinery of the load tests: processes, servers, percentiles, tables, plots.

Process handling, ports, HTTP probes and wrk come from bench_hit.py (one implementation);
this module adds what the experiments need on top: the demo model on disk, mlx_lm.server
under a chosen BLAS, cacheproxy in either mode, a private redis-server, Markdown and PNG.
Every child runs in its own session and is stopped by `Procs.close()`, which the `children()`
context manager calls on exit, on error and on Ctrl-C / SIGTERM (see `run`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hit import (  # noqa: E402  (re-exported for the experiments)
    LOAD_CORE,
    PATH,
    SERVER_CORE,
    WRK_LUA,
    BenchError,
    cpu_seconds,
    run_wrk,
    wrk_point,
)

# The process launcher and the Redis harness the tests use (bench_hit put the repository
# on the path).
from tests.harness.processes import (  # noqa: E402
    HOST,
    Procs,
    free_port,
    health_probe,
    http,
    wait_ready,
)
from tests.harness.processes import (
    OPENBLAS as OPENBLAS_PATH,
)
from tests.harness.processes import Child as Server  # noqa: E402
from tests.harness.redis_servers import (  # noqa: E402
    NoServerBinary,
    answers_ping,
    server_argv,
    server_binary,
)

__all__ = [
    "HOST", "LOAD_CORE", "PATH", "SERVER_CORE", "WRK_LUA", "BenchError", "Procs", "Server",
    "cpu_seconds", "free_port", "health_probe", "http", "run_wrk", "wait_ready", "wrk_point",
]

OPENBLAS = str(OPENBLAS_PATH)  # (the tests' own: tests/harness/processes.py)
RESULTS = Path(__file__).resolve().parent / "results"
ANIMALS = ["fox", "owl", "cat", "dog", "bear", "wolf", "deer", "frog", "duck", "horse",
           "rabbit", "mouse", "goat", "sheep", "cow", "pig", "hen", "bee", "fish", "eagle"]
QUESTIONS = ["What does the {a} eat?", "Where does the {a} live?", "Tell me about the {a}.",
             "What sound does the {a} make?", "Is the {a} big or small?"]


def animal_prompts(n: int) -> list[str]:
    """n distinct questions about the demo model's animals (deterministic; cycles with a tag)."""
    base = [q.format(a=a) for a in ANIMALS for q in QUESTIONS]
    out = []
    for i in range(n):
        text = base[i % len(base)]
        out.append(text if i < len(base) else f"{text} ({i // len(base)})")
    return out


def cacheproxy_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("cacheproxy")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "cacheproxy"]


def demo_model(work: Path) -> Path:
    """A copy of the bundled demo model in work/model (what mlx_lm.server serves), written
    as `cacheproxy demo-model --out` writes it, without an interpreter that imports mlx."""
    from cacheproxy.runners.demo.model import write_copy

    out = work / "model"
    if not out.exists():
        write_copy(out)
    return out


def blas_env(blas: str) -> list[str]:
    """The `env ...` prefix running a runner under a BLAS: 'wheel' (mlx[cpu]'s) or 'openblas'."""
    if blas == "wheel":
        return ["env", "-u", "LD_PRELOAD", "HF_HUB_OFFLINE=1"]
    if blas == "openblas":
        if not Path(OPENBLAS).exists():
            raise BenchError(f"{OPENBLAS} missing: apt-get install libopenblas0-pthread")
        return ["env", f"LD_PRELOAD={OPENBLAS}", "HF_HUB_OFFLINE=1"]
    raise BenchError(f"unknown BLAS {blas!r}: wheel or openblas")


def start_upstream(procs: Procs, work: Path, model_dir: Path, *, blas: str = "wheel",
                   core: int | None = None, port: int | None = None,
                   extra: Sequence[str] = ()) -> Server:
    """A `python -m mlx_lm.server` on the model directory, with its default batching."""
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    argv = [*blas_env(blas), sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
            "--host", HOST, "--port", str(port), "--log-level", "WARNING", *extra]
    return procs.launch("mlx_lm.server", argv, url, work / f"upstream-{port}.log",
                  health_probe(url), core=core)


def start_proxy(procs: Procs, work: Path, *args: str, core: int | None = None,
                port: int | None = None, log_level: str = "info",
                blas: str | None = None) -> Server:
    """`cacheproxy serve` with the given arguments (no model-file watching) on a free port
    (under a BLAS, as `blas_env`, when given: its in-process runner uses it)."""
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    argv = [*(blas_env(blas) if blas else []), *cacheproxy_cmd(), "serve", "--host", HOST,
            "--port", str(port), "--no-watch", "--log-level", log_level, *args]
    return procs.launch("cacheproxy", argv, url, work / f"cacheproxy-{port}.log",
                  health_probe(url), core=core)


def start_redis(procs: Procs, work: Path, *, port: int | None = None,
                core: int | None = None, extra: Sequence[str] = ()) -> Server:
    """A private redis-server on 127.0.0.1 without persistence (the tests' Redis harness)."""
    try:
        binary = server_binary()
    except NoServerBinary as exc:
        raise BenchError(str(exc)) from None
    port = port or free_port()
    return procs.launch("redis-server", server_argv(binary, port, work, *extra),
                        f"redis://{HOST}:{port}", work / f"redis-{port}.log",
                        lambda: answers_ping(port), core=core)


@contextlib.contextmanager
def children() -> Iterator[Procs]:
    """Procs that are all stopped on the way out, whatever happens."""
    procs = Procs()
    try:
        yield procs
    finally:
        procs.close()


def run(main: Callable[[argparse.Namespace], int], args: argparse.Namespace, name: str) -> int:
    """Run an experiment: SIGINT/SIGTERM unwind (stopping the servers); errors are one line."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return main(args)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; servers stopped", file=sys.stderr)
        return 130
    except (BenchError, subprocess.TimeoutExpired, TimeoutError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1


def pct(values: Sequence[float], p: float) -> float:
    """The p-quantile (0..1) by nearest rank; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p * (len(ordered) - 1))))]


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A Markdown table; align is one char per column ('l' or 'r', default right)."""
    marks = ["---" if (align[i:i + 1] or "r") == "l" else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def runtime_line() -> str:
    """Which machine and runtime measured this (for the results header)."""
    import platform
    from importlib.metadata import version

    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), "
            f"Python {platform.python_version()}, mlx {version('mlx')}, "
            f"mlx-lm {version('mlx-lm')}")


def figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (9, 4.5)) -> Any:
    """A matplotlib (Agg) figure and its axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"plot: {path}", file=sys.stderr)
    return path


def elapsed(t0: float) -> float:
    return round(time.monotonic() - t0, 1)
