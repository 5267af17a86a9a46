"""Redis fixtures: private servers on free ports, started once per session, flushed per test.

With no server binary on the machine, every test that asks for one fails with a message
saying how to get one (tests.harness.redis_servers.HOW_TO_GET_ONE); they are never skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.harness.redis_servers import (
    NoServerBinary,
    RedisClusterNodes,
    RedisServer,
    TlsServer,
    server_binary,
    start_cluster,
    start_server,
    start_tls_server,
)

StartServer = Callable[..., RedisServer]
T = TypeVar("T")


async def together(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """The calls run concurrently, their results in order, as asyncio.gather; but when one
    fails the others are cancelled and awaited before the test fails. (A gather left the other
    writes running: once, a cluster test that failed midway went on writing its 640 keys into
    the shared cluster after the next test had emptied it, and that test miscounted.)"""
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(call) for call in calls]
    return [task.result() for task in tasks]


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """Path of the redis-server (or valkey-server) binary the tests run."""
    try:
        return server_binary()
    except NoServerBinary as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def redis_server(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    """One standalone server for the session, also listening on a Unix socket."""
    directory = tmp_path_factory.mktemp("redis")
    server = start_server(
        redis_binary, directory, "--unixsocket", str(directory / "redis.sock"),
        "--unixsocketperm", "700",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_tls_server(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsServer]:
    """One standalone server for the session that also speaks TLS (rediss://)."""
    try:
        tls = start_tls_server(redis_binary, tmp_path_factory.mktemp("redis-tls"))
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield tls
    finally:
        tls.server.stop()


@pytest.fixture
def redis_tls_url(redis_tls_server: TlsServer) -> str:
    """The TLS session server's rediss:// URL (database 1), emptied for this test."""
    redis_tls_server.server.flushall()
    return redis_tls_server.url(1)


@pytest.fixture(scope="session")
def redis_cluster(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisClusterNodes]:
    """A Redis Cluster of three primaries for the session."""
    cluster = start_cluster(redis_binary, tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        for server in cluster.servers:
            server.stop()


# The session servers' URLs carry a connect timeout of 10 s (the stores' default is 1 s), as
# the TLS server's does: a contract test opens tens of connections at once, beside the other
# workers on 2 cores, and a connect to the loaded local server once took over 1 s (a test
# failed on it). What the default does is tested on servers of the tests' own.
SHARED_OPTIONS = "socket_connect_timeout=10"


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL (database 1, options: append with "&"), emptied for this
    test."""
    redis_server.flushall()
    return f"{redis_server.url}/1?{SHARED_OPTIONS}"


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisClusterNodes) -> str:
    """The session cluster's URL (options: append with "&"), every primary emptied for this
    test."""
    redis_cluster.flushall()
    return f"{redis_cluster.url}?{SHARED_OPTIONS}"


@pytest.fixture
def start_redis(redis_binary: str, tmp_path: Path) -> Iterator[StartServer]:
    """Start private servers for one test (extra args go to redis-server); all stopped after."""
    started: list[RedisServer] = []

    def start(*extra_args: str) -> RedisServer:
        server = start_server(redis_binary, tmp_path, *extra_args)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()
