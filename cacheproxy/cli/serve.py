"""`cacheproxy serve`: build the parts from the settings, hand them to the edge, run.

The face is the only place that reads `Settings`: it builds the runner (in-process or an
upstream pool), the store, the invalidator and the service, and the edge's options.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import resource
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import structlog
from aiohttp import web

from backends import redact_url
from backends.base import Backend
from cacheproxy.cli.settings import Settings, UpstreamPool
from cacheproxy.edge.apis import PARSERS
from cacheproxy.edge.app import create_app
from cacheproxy.edge.state import BODIES, CONNECTIONS, EdgeOptions
from cacheproxy.keys.budget import SchemaBudget
from cacheproxy.observe.logs import BatchedLines
from cacheproxy.runners.base import Runner
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from cacheproxy.runners.upstream import UpstreamRunner
from cacheproxy.runners.upstream_model import UpstreamOptions
from cacheproxy.service.cassette import open_store
from cacheproxy.service.invalidation import Invalidator
from cacheproxy.service.proxy import CachingProxy, ServiceOptions

log = structlog.get_logger("cacheproxy.serve")
FILES_BESIDES_CONNECTIONS = 64  # store, upstream, model and log files
BACKLOG = 1024  # connections the kernel queues before the server accepts them


def build_app(settings: Settings, *, runner: Runner | None = None,
              store: Backend | None = None) -> web.Application:
    """The application of `settings`; a given (already started) runner or store is used as
    is and left running at shutdown."""
    options = EdgeOptions(max_body_bytes=settings.max_body_bytes,
                          cache_scope=settings.cache_scope, api_keys=settings.api_keys,
                          admin_token=settings.admin_token,
                          status_access=settings.status_readers,
                          max_in_flight=settings.max_in_flight,
                          body_timeout=settings.body_timeout,
                          body_min_rate=settings.body_min_rate,
                          max_body_reads=settings.max_body_connections,
                          store_label=redact_url(settings.store),
                          bound_host=settings.host, allowed_hosts=settings.allowed_hosts,
                          allowed_origins=settings.allowed_origins)
    return create_app(options, partial(_parts, settings, runner, store))


def service_options(settings: Settings) -> ServiceOptions:
    """The service's knobs among the settings."""
    return ServiceOptions(sampling=settings.sampling, max_tokens_cap=settings.max_tokens_cap,
                          max_answer_tokens=settings.max_answer_tokens,
                          generation_timeout=settings.generation_timeout, ttl=settings.ttl,
                          store_retry=settings.store_retry, lock_ttl=settings.lock_ttl,
                          replay=settings.replay, shared_prefixes=settings.shared_prefixes,
                          schema_budget=SchemaBudget(
                              max_bytes=settings.max_schema_bytes,
                              max_properties=settings.max_schema_properties,
                              max_enum_values=settings.max_enum_values,
                              max_tools=settings.max_tools, max_depth=settings.max_schema_depth),
                          parse_timeout=settings.schema_timeout,
                          parse_off_loop=settings.parse_off_loop)


def build_runners(settings: Settings) -> list[Runner]:
    """One runner per served model: in-process, or an upstream pool per model directory."""
    if settings.upstream:
        return [_upstream_runner(settings, pool) for pool in settings.upstream_pools]
    return [_mlx_runner(settings, name, model) for name, model in settings.served_models]


def _upstream_runner(settings: Settings, pool: UpstreamPool) -> UpstreamRunner:
    return UpstreamRunner(UpstreamOptions(
        urls=pool.urls, model_dir=Path(pool.model_dir).expanduser(), model_id=pool.model_id,
        queue_size=settings.queue_size, default_max_tokens=settings.default_max_tokens,
        max_tokens_cap=settings.max_tokens_cap, device_scope=settings.device_scope,
        digest_memo=Path(settings.digest_memo), timeout=settings.upstream_timeout))


def _mlx_runner(settings: Settings, name: str, model: str) -> MlxRunner:
    return MlxRunner(MlxOptions(
        model=model, model_id=name,
        queue_size=settings.queue_size, default_max_tokens=settings.default_max_tokens,
        max_tokens_cap=settings.max_tokens_cap, device_scope=settings.device_scope,
        digest_memo=Path(settings.digest_memo), prefill_step=settings.prefill_step,
        prefix_cache_bytes=settings.prefix_cache_bytes, decode_slots=settings.decode_slots,
        prefill_process=settings.prefill_process, note_queueing=True))


@asynccontextmanager
async def _parts(settings: Settings, runner: Runner | None, store: Backend | None
                 ) -> AsyncIterator[list[tuple[CachingProxy, Invalidator]]]:
    """The served models, each with its own runner (lane), invalidator (watcher, lease,
    namespace) and proxy, over one store; the first is the default."""
    # A bad URL fails before the model loads.
    the_store = store or await open_store(settings.store, replay=settings.replay,
                                          record_key=settings.record_key.encode())
    runners = [runner] if runner is not None else build_runners(settings)
    served: list[tuple[CachingProxy, Invalidator]] = []
    started: list[Runner] = []
    registry_lock = asyncio.Lock()  # one registry change at a time among the models
    try:
        for the_runner in runners:
            if runner is None:
                await the_runner.start()
                started.append(the_runner)
            served.append(await _serve_model(settings, the_runner, the_store, registry_lock))
        yield served
    finally:
        for proxy, invalidator in served:
            await invalidator.aclose()
            await proxy.aclose()
        # Tear down only what this started; injected parts belong to the caller.
        if store is None:
            await the_store.aclose()
        for the_runner in started:
            await the_runner.aclose()


async def _serve_model(settings: Settings, runner: Runner, store: Backend,
                       registry_lock: asyncio.Lock) -> tuple[CachingProxy, Invalidator]:
    invalidator = Invalidator(runner, store, policy=settings.invalidation,
                              reload_wait=settings.reload_wait,
                              lease_ttl=settings.lease_ttl, grace=settings.supersede_grace,
                              registry_lock=registry_lock)
    await invalidator.start(watch_interval=settings.watch_interval if settings.watch else None)
    if isinstance(runner, UpstreamRunner):  # it sees engine changes by itself
        runner.on_fingerprint_change = invalidator.fingerprint_changed
    proxy = CachingProxy(runner, store, service_options(settings), parsers=PARSERS,
                         gate=invalidator.wait_ready, gate_open=invalidator.is_open)
    log.info("serving", model=runner.defaults().model_id,
             fingerprint=runner.fingerprint().digest, store=redact_url(settings.store))
    return proxy, invalidator


def serve(settings: Settings) -> int:
    """Run the server until SIGINT/SIGTERM."""
    import uvloop

    from cacheproxy.observe import logs, output

    files = resource.getrlimit(resource.RLIMIT_NOFILE)  # before mlx-lm is imported
    sock = bound_socket(settings.host, settings.port, send_buffer=settings.send_buffer)
    batched = logs.configure(fmt=settings.log_format, level=settings.log_level)
    if batched is not None:  # JSON logs: what anything prints from now on is JSON too
        output.capture(batched)
    uvloop.run(_serve(settings, batched, files, sock))
    # Everything is closed (stores, lanes). The process leaves without the interpreter's
    # teardown (cli/main.py::_leave), so the atexit hook of the batched log lines never runs:
    # flush them here.
    if batched is not None:
        batched.flush()
    return 0


def listening_socket(host: str, port: int, *, send_buffer: int = 0) -> socket.socket:
    """The server's socket, listening; with `send_buffer`, the kernel's send buffer of every
    connection it accepts (they inherit it): what a client that does not read can make the
    kernel hold (autotuned, up to 4 MB each on Linux; 100 unread answers held ~400 MB)."""
    sock = bound_socket(host, port, send_buffer=send_buffer)
    sock.listen(BACKLOG)
    return sock


def bound_socket(host: str, port: int, *, send_buffer: int = 0) -> socket.socket:
    """The server's socket, bound and not yet listening (connections are refused until the
    server starts, as before a model has loaded); a taken port is a one-line ValueError."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sock.family == socket.AF_INET6:  # as socket.create_server: IPv6 only
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if send_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind((host, port))
    except OSError as exc:  # one line and exit 2 (cli/main.py), before any model loads
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use") from None
        raise ValueError(f"cannot listen on {host} port {port}: {exc.strerror}") from None
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def say(batched: BatchedLines | None, event: str, message: str, level: str = "info"
        ) -> None:
    """A line for the operator whatever the log level: as is on stderr, or one JSON line
    among the others when the logs are JSON (every line of the output parses then)."""
    if batched is not None:
        batched.notice(event, message, level)
    else:
        print(message, file=sys.stderr, flush=True)


def restore_file_limit(before: tuple[int, int], max_connections: int,
                       batched: BatchedLines | None = None) -> None:
    """mlx-lm sets the open-file limit to (2048, 4096) when it is imported (mlx_lm/utils.py):
    put back the limit the process started with, or as much of it as it may (raising a hard
    limit takes privileges), and warn when that leaves too few for max_connections."""
    now = resource.getrlimit(resource.RLIMIT_NOFILE)
    if now != before:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, before)
        except (ValueError, OSError):  # the hard limit stays lowered: the soft one up to it
            soft, hard = before[0], now[1]
            if hard != resource.RLIM_INFINITY and (soft == resource.RLIM_INFINITY or soft > hard):
                soft = hard
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < max_connections + FILES_BESIDES_CONNECTIONS:
        say(batched, "file_limit_low",
            f"cacheproxy: WARNING: the open-file limit ({soft}) leaves room for fewer than "
            f"--max-connections {max_connections} client connections; raise it (ulimit -n) "
            "or lower --max-connections", "warning")


async def _serve(settings: Settings, batched: BatchedLines | None,
                 files: tuple[int, int], sock: socket.socket) -> None:
    from cacheproxy.edge.aiohttp_adapter import ConnectionGuard
    from cacheproxy.observe import logs

    flusher = asyncio.create_task(logs.flush_periodically(batched)) if batched else None
    # keepalive_timeout: aiohttp closes a connection still waiting for a request's headers
    # that long after it opened or after its last response (slowloris, idle keep-alive).
    app = build_app(settings)
    counters: dict[str, int] = {}
    app[CONNECTIONS] = counters  # (before the app starts: it is frozen then)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=settings.idle_timeout)
    await runner.setup()
    watcher = None
    if runner.server is not None:
        guard = ConnectionGuard(runner.server, settings.max_connections,
                                max_per_peer=settings.max_connections_per_peer,
                                send_timeout=settings.send_timeout, counters=counters,
                                bodies=app[BODIES])
        guard.install()
        watcher = asyncio.create_task(guard.watch())
    # Bound first (a taken port fails before the model loads), listening from now on.
    site = web.SockSite(runner, sock, backlog=BACKLOG)
    await site.start()
    restore_file_limit(files, settings.max_connections, batched)  # (mlx-lm imported now)
    # The model, tokenizer and imports are ~100k long-lived objects: out of the collector's
    # sight, a full collection no longer rescans them (it cost ~80 ms every ~20k hits).
    gc.collect()
    gc.freeze()
    _announce(settings, batched)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
        await runner.cleanup()
        if flusher is not None:
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)


def _announce(settings: Settings, batched: BatchedLines | None = None) -> None:
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        say(batched, "no_api_keys",
            f"cacheproxy: WARNING: listening on {settings.host} without API keys: anyone who "
            "can reach this address can generate and read cached answers "
            "(set --api-key or CACHEPROXY_API_KEYS)", "warning")
    names = [pool.model_id for pool in settings.upstream_pools] if settings.upstream else \
        [name for name, _ in settings.served_models]
    say(batched, "listening",
        f"cacheproxy serving {', '.join(names)} on http://{settings.host}:"
        f"{settings.port}/v1 (store {redact_url(settings.store)})")
