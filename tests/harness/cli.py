"""The command line in-process: `cacheproxy ARGS` through `cli.main.run`, its output
captured and no terminal on its stdin (what `main()` adds, the process exit, is tested in
tests/system). Output streams are the process's: run one command at a time. Not `serve`:
it binds its port and configures the whole process's logging (tests/system runs it)."""

from __future__ import annotations

import asyncio
import io
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

from cacheproxy.cli.main import run


@dataclass(frozen=True, slots=True)
class Done:
    """A finished command: its exit status and what it wrote."""

    returncode: int
    stdout: str
    stderr: str


def cacheproxy_sync(*args: str, check: bool = True) -> Done:
    """Run one command (from a thread without an event loop: commands run their own)."""
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()
    stdin, sys.stdin = sys.stdin, io.StringIO()  # no terminal to ask (as stdin=DEVNULL)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = run(list(args))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 2
            out.flush()
    finally:
        sys.stdin = stdin
    done = Done(code, out.buffer.getvalue().decode(), err.getvalue())  # type: ignore[attr-defined]
    if check:
        assert done.returncode == 0, done.stderr
    return done


async def cacheproxy(*args: str, check: bool = True) -> Done:
    """Run one command from a test that has an event loop (the command gets a thread)."""
    return await asyncio.to_thread(cacheproxy_sync, *args, check=check)


def cacheproxy_blocking(*args: str, check: bool = False) -> Done:
    """Run one command from an async test, blocking its loop as a subprocess.run would (the
    command runs on a thread of its own: it starts an event loop of its own)."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(cacheproxy_sync, *args, check=check).result()
