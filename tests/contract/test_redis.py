"""Redis-specific behaviour: failures, reconnects, the cluster, pool bounds, server-side limits.

The byte-level contract itself runs in tests/contract/test_store_contract.py against Redis
and the cluster.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import redis

from backends import BackendError, RedisBackend, listing, open_backend
from backends.redis_keyspace import _PAGE_SCANS, _PURGE_REST, _PURGE_STEP
from backends.resp import LaneError
from tests.harness.redis_fixtures import StartServer, together
from tests.harness.redis_servers import RedisClusterNodes, RedisServer, TlsServer, free_port


def open_redis(url: str) -> RedisBackend:
    backend = open_backend(url)
    assert isinstance(backend, RedisBackend)
    return backend


async def silent_server() -> tuple[asyncio.Server, int]:
    """A TCP server that accepts connections and never answers."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


def info(server: RedisServer, section: str) -> dict[str, object]:
    with server.client() as client:
        result: dict[str, object] = client.info(section)
        return result


@pytest.mark.asyncio
class TestFailures:
    @pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
    async def test_unreachable_server_is_a_quick_backend_error(self, scheme: str) -> None:
        store = open_redis(f"{scheme}://127.0.0.1:{free_port()}")
        started = time.monotonic()
        try:
            with pytest.raises(BackendError, match="Error"):
                await store.get("k")
            with pytest.raises(BackendError):
                await store.set("k", b"v")
        finally:
            await store.aclose()
        assert time.monotonic() - started < 1.0

    async def test_silent_server_times_out_as_configured(self) -> None:
        server, port = await silent_server()
        store = open_redis(f"redis://127.0.0.1:{port}/0?socket_timeout=0.2")
        started = time.monotonic()
        try:
            with pytest.raises(BackendError, match="Timeout"):
                await store.get("k")
        finally:
            await store.aclose()
            server.close()
            await server.wait_closed()
        assert 0.15 < time.monotonic() - started < 1.5

    async def test_stopped_server_fails_then_restarted_server_works(
        self, start_redis: StartServer
    ) -> None:
        server = start_redis()
        store = open_redis(server.url)
        try:
            await store.set("k", b"before")
            assert await store.get("k") == b"before"
            server.stop()
            with pytest.raises(BackendError):
                await store.get("k")
            server.start()  # same port, empty: nothing was persisted
            assert await store.get("k") is None
            await store.set("k", b"after")
            assert await store.get("k") == b"after"
        finally:
            await store.aclose()

    async def test_out_of_memory_is_a_backend_error(self, start_redis: StartServer) -> None:
        server = start_redis("--maxmemory-policy", "noeviction")
        used = int(str(info(server, "memory")["used_memory"]))
        with server.client() as client:
            client.config_set("maxmemory", used + 1_000_000)
        store = open_redis(server.url)
        try:
            await store.set("first", b"x" * 200_000)
            with pytest.raises(BackendError, match="OOM|memory"):
                for i in range(20):
                    await store.set(f"k{i}", b"x" * 200_000)
            assert await store.get("first") == b"x" * 200_000  # reads still work
        finally:
            await store.aclose()


@pytest.mark.asyncio
class TestServerSide:
    async def test_get_is_a_single_get_command(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        store = open_redis(redis_url)
        try:
            await store.set("hot", b"x" * 500)
            await store.get("hot")  # connects (HELLO, CLIENT SETINFO, SELECT) before counting
            with redis_server.client() as client:
                client.ping()
                client.config_resetstat()
                for _ in range(100):
                    assert await store.get("hot") == b"x" * 500
                stats = client.info("commandstats")
        finally:
            await store.aclose()
        assert set(stats) <= {"cmdstat_get", "cmdstat_config|resetstat", "cmdstat_info"}
        get_stats = stats["cmdstat_get"]
        assert isinstance(get_stats, dict)
        assert get_stats["calls"] == 100

    async def test_ttl_becomes_px_milliseconds(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        store = open_redis(redis_url)
        try:
            await store.set("short", b"v", ttl=0.25)
            await store.set("tiny", b"v", ttl=0.0001)
            await store.set("long", b"v", ttl=100)
            await store.set("forever", b"v")
            with redis.Redis(port=redis_server.port, db=1) as client:
                assert 0 < client.pttl("short") <= 250
                assert client.pttl("tiny") in (-2, 0, 1)  # 1 ms, so maybe gone already
                assert 99_000 < client.pttl("long") <= 100_000
                assert client.pttl("forever") == -1
        finally:
            await store.aclose()

    async def test_stats_report_maxmemory(self, start_redis: StartServer, redis_url: str) -> None:
        bounded = open_redis(start_redis("--maxmemory", "10mb").url)
        unbounded = open_redis(redis_url)
        try:
            await bounded.set("ns/a", b"12345")
            result = await bounded.stats()
            assert (result.entries, result.max_bytes) == (1, 10 * 1024 * 1024)
            assert result.bytes > 0  # used_memory: the server's whole footprint
            assert (await unbounded.stats()).max_bytes is None
        finally:
            await bounded.aclose()
            await unbounded.aclose()

    async def test_allkeys_lru_evicts_approximately(self, start_redis: StartServer) -> None:
        server = start_redis("--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru")
        store = open_redis(server.url)
        try:
            for i in range(200):  # 20 MB through an 8 MB server
                await store.set(f"ns/{i:03d}", os.urandom(100_000))
            assert await store.get("ns/199") is not None
            entries, _ = await store.namespace_stats("ns")
            assert 20 < entries < 200
            assert int(str(info(server, "stats")["evicted_keys"])) >= 200 - entries
        finally:
            await store.aclose()

    async def test_unix_socket_url_with_db(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        socket_path = redis_server.directory / "redis.sock"
        store = open_redis(f"unix://{socket_path}?db=2")
        try:
            await store.set("via-socket", b"v")
            assert await store.get("via-socket") == b"v"
        finally:
            await store.aclose()
        with redis.Redis(port=redis_server.port, db=2) as client:
            assert client.get("via-socket") == b"v"


@pytest.fixture(params=["redis", "redis-cluster"])
def shared_store_url(request: pytest.FixtureRequest) -> str:
    """The session server's or the session cluster's URL, emptied for this test."""
    fixture = "redis_url" if request.param == "redis" else "redis_cluster_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.mark.asyncio
class TestLoad:
    async def test_writers_beyond_max_connections_wait_their_turn(
        self, shared_store_url: str
    ) -> None:
        store = open_redis(shared_store_url + "&max_connections=4")
        keys = [f"load/{i}" for i in range(400)]
        try:
            await together(store.set(k, k.encode()) for k in keys)
            assert await asyncio.gather(*(store.get(k) for k in keys)) == [
                k.encode() for k in keys
            ]
            assert await store.namespace_stats("load") == (400, sum(2 * len(k) for k in keys))
        finally:
            await store.aclose()

    async def test_large_binary_values_concurrently(self, shared_store_url: str) -> None:
        store = open_redis(shared_store_url)
        values = {f"big/{i}": os.urandom(5 * 1024 * 1024) for i in range(4)}
        try:
            await together(store.set(k, v) for k, v in values.items())
            got = await asyncio.gather(*(store.get(k) for k in values))
            assert got == list(values.values())
            assert await store.namespace_stats("big") == (
                4, sum(len(k) + len(v) for k, v in values.items())
            )  # fmt: skip
        finally:
            await store.aclose()

    async def test_connections_stay_within_max_connections(
        self, shared_store_url: str, request: pytest.FixtureRequest
    ) -> None:
        store = open_redis(shared_store_url + "&max_connections=3")
        stop = asyncio.Event()

        async def writer(i: int) -> None:
            while not stop.is_set():
                await store.set(f"c/{i}", b"v" * 1000)

        tasks = [asyncio.create_task(writer(i)) for i in range(40)]
        try:
            await asyncio.sleep(0.3)
            for server in _servers(request):
                with server.client() as client:
                    commands = [c["cmd"] for c in client.client_list()]
                # Not counted: this client, and the cluster client's discovery connection.
                ours = [c for c in commands if c not in ("client|list", "cluster|slots")]
                assert 1 <= len(ours) <= 3
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await store.aclose()


def _fill(request: pytest.FixtureRequest, url: str, keys: set[str]) -> None:
    """Write keys (value b"v") through pipelines of a plain client: the listing tests need
    many keys, not the store's writes (20k of those cost ~4 s of CPU)."""
    servers = _servers(request)
    client: redis.Redis | redis.RedisCluster = (
        redis.Redis.from_url(url) if len(servers) == 1
        else redis.RedisCluster(host="127.0.0.1", port=servers[0].port))
    with client:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, b"v")
        pipe.execute()


def _calls(request: pytest.FixtureRequest, command: str) -> int:
    """How many times the servers have run command so far."""
    total = 0
    for server in _servers(request):
        stat = info(server, "commandstats").get(f"cmdstat_{command}")
        total += int(stat["calls"]) if isinstance(stat, dict) else 0
    return total


def _scans(request: pytest.FixtureRequest) -> int:
    """SCAN commands the servers have run so far."""
    return _calls(request, "scan")


@pytest.mark.asyncio
class TestListing:
    async def test_a_page_costs_a_page_however_many_keys_there_are(
        self, shared_store_url: str, request: pytest.FixtureRequest
    ) -> None:
        store = open_redis(shared_store_url)
        keys = {f"ns/{i:06d}" for i in range(20_000)}
        try:
            _fill(request, shared_store_url, keys)
            before = _scans(request)
            page, cursor = await store.scan_page("ns/", limit=1000)
            # The old listing SCANned all 20k keys (20+ SCANs of 1000) and sorted them.
            assert _scans(request) - before <= _PAGE_SCANS
            assert 1000 <= len(page) < 2000 and cursor  # COUNT is a hint: about a page
            seen = set(page)
            while cursor:
                page, cursor = await store.scan_page("ns/", cursor=cursor, limit=1000)
                seen.update(page)
            assert seen == keys
        finally:
            await store.aclose()

    async def test_a_sparse_prefix_gives_short_pages_each_bounded(
        self, shared_store_url: str, request: pytest.FixtureRequest
    ) -> None:
        store = open_redis(shared_store_url)
        try:
            _fill(request, shared_store_url,
                  {f"other/{i}" for i in range(3000)} | {f"few/{i}" for i in range(3)})
            before = _scans(request)
            page, cursor = await store.scan_page("few/", limit=10)
            assert _scans(request) - before <= _PAGE_SCANS and cursor  # not the whole keyspace
            assert await listing.keys(store, "few/") == ["few/0", "few/1", "few/2"]
        finally:
            await store.aclose()

    async def test_a_purge_takes_small_steps_and_rests_between_them(
        self, shared_store_url: str, request: pytest.FixtureRequest
    ) -> None:
        store = open_redis(shared_store_url)
        try:
            await together(store.set(f"old/{i}", b"v") for i in range(640))
            await store.set("new/1", b"v")
            unlinks = _calls(request, "unlink")
            started = time.monotonic()
            assert await store.purge_namespace("old") == 640
            took = time.monotonic() - started
            # Each UNLINK holds Redis for every other client: 32 keys at a time (a cluster
            # splits a step by slot: more calls), with a rest of >= 1 ms after each.
            assert _calls(request, "unlink") - unlinks >= 640 // _PURGE_STEP
            assert took >= (640 // _PURGE_STEP - 1) * _PURGE_REST
            assert await store.get("new/1") == b"v"
        finally:
            await store.aclose()

    async def test_a_cursor_on_a_primary_that_is_gone_is_an_error(
        self, redis_cluster_url: str
    ) -> None:
        store = open_redis(redis_cluster_url)
        try:
            await store.set("k/1", b"v")
            with pytest.raises(BackendError, match="primaries changed"):
                await store.scan_page("k/", cursor=f"127.0.0.1:{free_port()}/5")
        finally:
            await store.aclose()


def _servers(request: pytest.FixtureRequest) -> list[RedisServer]:
    if request.node.callspec.params["shared_store_url"] == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return [server]
    cluster: RedisClusterNodes = request.getfixturevalue("redis_cluster")
    return cluster.servers


@pytest.mark.asyncio
class TestCluster:
    async def test_purge_reaches_every_primary(
        self, redis_cluster: RedisClusterNodes, redis_cluster_url: str
    ) -> None:
        store = open_redis(redis_cluster_url)
        try:
            for i in range(300):
                await store.set(f"old/{i}", b"v")
            for i in range(30):
                await store.set(f"new/{i}", b"v")
            held = [_count(server, "old/*") for server in redis_cluster.servers]
            assert all(n > 0 for n in held) and sum(held) == 300  # spread over all three
            assert await store.purge_namespace("old") == 300
            assert [_count(server, "old/*") for server in redis_cluster.servers] == [0, 0, 0]
            assert sum(_count(server, "new/*") for server in redis_cluster.servers) == 30
            assert await listing.keys(store, "") == sorted(f"new/{i}" for i in range(30))
        finally:
            await store.aclose()

    async def test_stats_sum_over_primaries(
        self, redis_cluster: RedisClusterNodes, redis_cluster_url: str
    ) -> None:
        store = open_redis(redis_cluster_url)
        try:
            for i in range(60):
                await store.set(f"s/{i}", b"v")
            result = await store.stats()
            used = sum(int(str(info(s, "memory")["used_memory"])) for s in redis_cluster.servers)
        finally:
            await store.aclose()
        assert result.entries == 60
        assert result.max_bytes is None
        assert 0.5 * used < result.bytes < 2 * used


def _count(server: RedisServer, pattern: str) -> int:
    with server.client() as client:
        return sum(1 for _ in client.scan_iter(match=pattern, count=1000))


@pytest.mark.asyncio
class TestGetLane:
    """GETs of a single server go through backends/resp.py's pipelined connection."""

    async def test_concurrent_gets_each_get_their_own_reply(self, redis_url: str) -> None:
        store = open_redis(redis_url)
        try:
            values = {f"k{i}": os.urandom(i % 700) + str(i).encode() for i in range(300)}
            for key, value in values.items():
                await store.set(key, value)
            keys = [*values, "absent"] * 3
            got = await asyncio.gather(*(store.get(key) for key in keys))
            assert got == [values.get(key) for key in keys]
            # 903 GETs at once, pipelined on one connection (the pool's writer is the other).
            with redis.Redis.from_url(redis_url) as client:
                clients = client.client_list()
            assert len(clients) <= 3, clients
        finally:
            await store.aclose()

    async def test_a_purge_runs_on_a_lane_of_its_own(self, redis_url: str) -> None:
        store = open_redis(redis_url)
        try:
            with redis.Redis.from_url(redis_url) as client:
                client.mset({f"p/{i}": b"v" for i in range(2000)})
            assert await store.get("p/0") == b"v"  # the GET lane is connected
            purge = asyncio.create_task(store.purge_namespace("p"))
            seen: list[set[str]] = []  # each connection's last command, while it runs
            while not purge.done():  # (63 steps of >= 1 ms each)
                with redis.Redis.from_url(redis_url) as client:
                    seen.append({c["cmd"] for c in client.client_list()})
                await asyncio.sleep(0.005)
            assert any({"get", "scan"} <= s or {"get", "unlink"} <= s for s in seen), seen
            assert await purge == 2000
            lane = store._lane
            assert lane is not None
            sibling = lane.sibling()
            try:
                with pytest.raises(LaneError, match="unknown command"):
                    await sibling.call(b"NO-SUCH-COMMAND")
            finally:
                sibling.close()
        finally:
            await store.aclose()

    async def test_a_cancelled_get_leaves_the_next_replies_in_order(
        self, redis_url: str
    ) -> None:
        store = open_redis(redis_url)
        try:
            await store.set("a", b"A")
            await store.set("b", b"B")
            assert await store.get("a") == b"A"  # connected
            early = asyncio.create_task(store.get("a"))
            await asyncio.sleep(0)  # the GET is written; its reply is not read yet
            early.cancel()
            assert await asyncio.gather(store.get("b"), store.get("a")) == [b"B", b"A"]
        finally:
            await store.aclose()

    async def test_a_busy_server_times_out_then_answers_again(
        self, start_redis: StartServer
    ) -> None:
        server = start_redis("--enable-debug-command", "yes")
        store = open_redis(server.url + "/0?socket_timeout=0.3")
        try:
            await store.set("k", b"v")
            assert await store.get("k") == b"v"
            with server.client() as client:
                busy = asyncio.create_task(asyncio.to_thread(client.execute_command,
                                                             "DEBUG", "SLEEP", "1.2"))
                await asyncio.sleep(0.1)
                started = time.monotonic()
                with pytest.raises(BackendError, match="Timeout"):
                    await store.get("k")
                assert time.monotonic() - started < 0.55  # one deadline, not retried
                await busy
            assert await store.get("k") == b"v"  # a new connection
        finally:
            await store.aclose()

    async def test_password_and_database_from_the_url(self, start_redis: StartServer) -> None:
        server = start_redis()
        with server.client() as client:
            client.select(3)
            client.set("k", b"in db 3")
            client.config_set("requirepass", "s3cret")
        good = open_redis(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        wrong = open_redis(f"redis://:nope@127.0.0.1:{server.port}/3")
        try:
            assert await good.get("k") == b"in db 3"
            with pytest.raises(BackendError, match="refused|WRONGPASS|invalid"):
                await wrong.get("k")
        finally:
            await good.aclose()
            await wrong.aclose()
            with redis.Redis(port=server.port, password="s3cret") as client:
                client.config_set("requirepass", "")

    async def test_a_key_of_another_type_is_a_backend_error(self, redis_url: str) -> None:
        store = open_redis(redis_url)
        try:
            with redis.Redis.from_url(redis_url) as client:
                client.rpush("list", "x")
            with pytest.raises(BackendError, match="WRONGTYPE"):
                await store.get("list")
            await store.set("k", b"v")
            assert await store.get("k") == b"v"  # the connection is still good
        finally:
            await store.aclose()

    async def test_tracked_replies_stay_in_order_among_invalidations(
        self, redis_url: str
    ) -> None:
        store = open_redis(redis_url)
        heard: list[str | None] = []
        assert store.track(heard.append, lambda: None)
        keys = [f"k{i}" for i in range(50)]
        try:
            for key in keys:
                await store.set(key, f"{key}=0".encode())
            stop = threading.Event()

            def overwrite() -> None:  # another client, changing what the lane reads
                with redis.Redis.from_url(redis_url) as client:
                    n = 0
                    while not stop.is_set():
                        n += 1
                        client.mset({key: f"{key}={n}" for key in keys})

            writer = threading.Thread(target=overwrite)
            writer.start()
            try:
                for _ in range(40):
                    got = await asyncio.gather(*(store.get(key) for key in keys))
                    assert [v.split(b"=")[0].decode() for v in got if v] == keys
            finally:
                stop.set()
                writer.join()
            assert set(heard) <= {*keys, None} and len(set(heard) - {None}) > 25
        finally:
            await store.aclose()

    async def test_tracking_after_password_and_database(self, start_redis: StartServer) -> None:
        server = start_redis()
        with server.client() as client:
            client.config_set("requirepass", "s3cret")
        store = open_redis(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        heard: list[str | None] = []
        restarts: list[int] = []
        assert store.track(heard.append, lambda: restarts.append(1))
        try:
            assert await store.get("k") is None
            assert restarts == [1] and store.tracking_refused is None
            with redis.Redis(port=server.port, password="s3cret", db=3) as client:
                client.set("k", b"v")
            deadline = time.monotonic() + 2
            while "k" not in heard:
                assert time.monotonic() < deadline, heard
                await asyncio.sleep(0.01)
            assert await store.get("k") == b"v"
        finally:
            await store.aclose()


@pytest.mark.asyncio
class TestTls:
    """rediss:// against a server with a certificate from a test CA (trustme)."""

    async def test_gets_are_pipelined_on_one_verified_connection(
        self, redis_tls_url: str, redis_tls_server: TlsServer
    ) -> None:
        store = open_redis(redis_tls_url)
        try:
            values = {f"k{i}": os.urandom(i % 300) + str(i).encode() for i in range(100)}
            for key, value in values.items():
                await store.set(key, value)
            keys = [*values, "absent"] * 3
            assert await asyncio.gather(*(store.get(k) for k in keys)) == \
                [values.get(k) for k in keys]
            with redis_tls_server.server.client() as client:  # over the plain port
                clients = client.client_list()
            assert len(clients) <= 3, clients  # redis-py would have opened up to 64
        finally:
            await store.aclose()

    async def test_an_untrusted_server_is_refused(self, redis_tls_server: TlsServer) -> None:
        url = f"rediss://127.0.0.1:{redis_tls_server.tls_port}/1"  # the system's CAs only
        store = open_redis(url)
        try:
            with pytest.raises(BackendError, match="CERTIFICATE_VERIFY_FAILED"):
                await store.get("k")  # the GET lane
            with pytest.raises(BackendError, match="CERTIFICATE_VERIFY_FAILED"):
                await store.set("k", b"v")  # redis-py
        finally:
            await store.aclose()
        unchecked = open_redis(url + "?ssl_cert_reqs=none")
        try:
            await unchecked.set("k", b"v")
            assert await unchecked.get("k") == b"v"
        finally:
            await unchecked.aclose()

    async def test_a_missing_ca_file_is_a_bad_url(self, redis_tls_server: TlsServer) -> None:
        for scheme in ("rediss", "rediss+cluster"):  # a mistake told at start, not per GET
            with pytest.raises(ValueError, match="TLS set-up failed"):
                open_redis(f"{scheme}://127.0.0.1:{redis_tls_server.tls_port}"
                           "?ssl_ca_certs=/nonexistent/ca.pem")
