"""Invalidation: a changed quant file, engine version or corrupt file, seen live or at start-up."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import shutil
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from backends import open_backend
from backends.base import Backend, NamespaceStats
from backends.tiered import TieredBackend
from cacheproxy.cli.serve import build_app
from cacheproxy.cli.settings import Settings
from cacheproxy.edge.state import INVALIDATOR, PROXY
from cacheproxy.keys import codec
from cacheproxy.keys import fingerprint as fp
from cacheproxy.keys.fingerprint import EngineVersions, installed_versions
from cacheproxy.runners.demo.model import write_copy
from cacheproxy.runners.mlx import MlxOptions, MlxRunner
from cacheproxy.service.invalidation import Invalidator
from cacheproxy.service.namespaces import REGISTRY_KEY, Registry
from policies.invalidation import InvalidationPolicy
from tests.conftest import Proxy, ProxyFactory, asker, eventually, free_port, miss_then_hit
from tests.harness.redis_fixtures import StartServer

FINGERPRINT_A = fp.compute("demo", Path(__file__).resolve().parents[2] / "cacheproxy" /
                           "runners" / "demo" / "data" / "demo-model")

BODY = {"prompt": "The fox", "max_tokens": 16}


@pytest.fixture(scope="session")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The demo model quantized to 4 and 8 bits with mlx-lm's convert, made once."""
    base = tmp_path_factory.mktemp("quantized")
    return {bits: write_copy(base / f"q{bits}", quantize=bits) for bits in (4, 8)}


@pytest_asyncio.fixture
async def own_runner() -> AsyncIterator[list[MlxRunner]]:
    """Runners a test starts on its own model directory; all closed at teardown."""
    runners: list[MlxRunner] = []
    yield runners
    for r in runners:
        await r.aclose()


async def _start(runners: list[MlxRunner], model: Path, **kw: object) -> MlxRunner:
    r = MlxRunner(MlxOptions(model=str(model), model_id="demo"), **kw)  # type: ignore[arg-type]
    await r.start()
    runners.append(r)
    return r


async def _complete(proxy: Proxy) -> tuple[int, dict[str, str], dict[str, object]]:
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/completions", json=BODY) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def _namespace_entries(proxy: Proxy, digest: str) -> int:
    assert isinstance(proxy.store, NamespaceStats)
    return (await proxy.store.namespace_stats(digest))[0]


async def test_quant_file_replaced_while_serving(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], quantized: dict[int, Path],
    tmp_path: Path,
) -> None:
    served = tmp_path / "served"
    shutil.copytree(quantized[4], served)
    runner = await _start(own_runner, served)
    proxy = await make_proxy(the_runner=runner, watch_interval=0.1)
    status, h1, body1 = await _complete(proxy)
    old = h1["X-Cache-Fingerprint"]
    assert status == 200 and h1["X-Cache"] == "MISS" and body1["system_fingerprint"] == old
    assert await _namespace_entries(proxy, old) == 1

    for name in ("config.json", "model.safetensors"):  # the 8-bit files replace the 4-bit ones
        shutil.copy2(quantized[8] / name, served / name)
    await eventually(lambda: runner.fingerprint().digest != old, within=20, every=0.05)

    status, h2, body2 = await _complete(proxy)
    new = h2["X-Cache-Fingerprint"]
    assert status == 200 and h2["X-Cache"] == "MISS"
    assert new != old and body2["system_fingerprint"] == new
    assert runner.fingerprint().quantization["bits"] == 8
    await proxy.app[INVALIDATOR].idle()
    assert await _namespace_entries(proxy, old) == 0  # purged in the background
    registry = await Registry(proxy.store).load()
    assert registry[old].state == "superseded" and registry[new].state == "current"
    assert proxy.app[INVALIDATOR].counters["entries_purged"] == 1


async def test_engine_upgrade_at_start_up_supersedes_and_purges(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], tmp_path: Path,
) -> None:
    model = write_copy(tmp_path / "model")
    store = f"disk://{tmp_path}/store"

    def old_engine() -> EngineVersions:
        return EngineVersions(engine_version="0.0.1", mlx_version="0.0.1")

    before = await make_proxy(store=store, the_runner=await _start(own_runner, model,
                                                                  versions=old_engine))
    _, h1, _ = await _complete(before)
    old = h1["X-Cache-Fingerprint"]
    assert h1["X-Cache"] == "MISS" and await _namespace_entries(before, old) == 1
    await before.stop()  # (its lease released: superseded once the grace period is over)

    # The same model and store, restarted on the installed engine versions.
    after = await make_proxy(store=store, supersede_grace=0.0, the_runner=await _start(
        own_runner, model, versions=installed_versions))
    await after.app[INVALIDATOR].idle()
    assert await _namespace_entries(after, old) == 0
    _, h2, _ = await _complete(after)
    assert h2["X-Cache"] == "MISS" and h2["X-Cache-Fingerprint"] != old
    assert (await Registry(after.store).load())[old].state == "superseded"


async def test_retain_policy_keeps_superseded_entries_unreachable(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], tmp_path: Path,
) -> None:
    model = write_copy(tmp_path / "model")
    store = f"disk://{tmp_path}/store"
    first = await make_proxy(store=store, the_runner=await _start(
        own_runner, model, versions=lambda: EngineVersions("1", "1")))
    _, h1, _ = await _complete(first)
    second = await make_proxy(store=store, invalidation=InvalidationPolicy.RETAIN,
                              the_runner=await _start(own_runner, model,
                                                      versions=lambda: EngineVersions("2", "1")))
    await second.app[INVALIDATOR].idle()
    old = h1["X-Cache-Fingerprint"]
    assert await _namespace_entries(second, old) == 1  # kept for audit
    _, h2, _ = await _complete(second)
    assert h2["X-Cache"] == "MISS"  # but never served under the new fingerprint


async def test_half_written_file_is_not_loaded_and_a_corrupt_one_keeps_the_old_model(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], quantized: dict[int, Path],
    tmp_path: Path,
) -> None:
    served = write_copy(tmp_path / "served")
    runner = await _start(own_runner, served)
    proxy = await make_proxy(the_runner=runner, watch_interval=0.3)
    invalidator = proxy.app[INVALIDATOR]
    first = runner.fingerprint().digest

    # Write the 8-bit weights slowly: the size moves between every two polls.
    shutil.copy2(quantized[8] / "config.json", served / "config.json")
    content = (quantized[8] / "model.safetensors").read_bytes()
    with (served / "model.safetensors").open("wb") as f:
        for i in range(20):
            f.write(content[i * len(content) // 20:(i + 1) * len(content) // 20])
            f.flush()
            await asyncio.sleep(0.05)
            assert invalidator.counters["reload_failures"] == 0
            assert runner.reloads == 0, "a half-written file was loaded"
    await eventually(lambda: runner.reloads == 1, within=20, every=0.05)
    second = runner.fingerprint().digest
    assert second != first and invalidator.counters["reload_failures"] == 0

    # Now a complete but corrupt weight file: the load fails, the 8-bit model keeps serving.
    (served / "model.safetensors").write_bytes(b"\x00garbage" * 4096)
    await eventually(lambda: invalidator.counters["reload_failures"] == 1, within=20, every=0.05)
    assert runner.fingerprint().digest == second
    status, headers, body = await _complete(proxy)
    assert status == 200 and headers["X-Cache-Fingerprint"] == second and body["choices"]
    await asyncio.sleep(1.0)  # the same broken files are not retried in a loop
    assert invalidator.counters["reload_failures"] == 1


async def _serving_q4(make_proxy: ProxyFactory, own_runner: list[MlxRunner],
                      quantized: dict[int, Path], tmp_path: Path) -> tuple[MlxRunner, Proxy]:
    """A proxy over a runner serving a copy of the 4-bit model in tmp_path/served."""
    served = tmp_path / "served"
    shutil.copytree(quantized[4], served)
    runner = await _start(own_runner, served)
    return runner, await make_proxy(the_runner=runner, watch=False)


async def _during_a_reload_to_q8(proxy: Proxy, quantized: dict[int, Path], tmp_path: Path
                                 ) -> tuple[int, dict[str, str]]:
    """Swap the served files for the 8-bit model, reload, and send a request while the
    reload holds the gate; its status and headers once the reload is done."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(quantized[8] / name, tmp_path / "served" / name)
    reload = asyncio.create_task(proxy.app[INVALIDATOR].reload())
    await asyncio.sleep(0)  # the reload has closed the gate
    status, headers, _ = await _complete(proxy)  # arrives during the reload: waits
    await reload
    return status, headers


async def test_requests_during_a_reload_wait_and_key_under_the_new_fingerprint(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], quantized: dict[int, Path],
    tmp_path: Path,
) -> None:
    runner, proxy = await _serving_q4(make_proxy, own_runner, quantized, tmp_path)
    old = runner.fingerprint().digest
    status, headers = await _during_a_reload_to_q8(proxy, quantized, tmp_path)
    assert status == 200
    assert headers["X-Cache-Fingerprint"] == runner.fingerprint().digest != old


async def test_a_reload_under_a_frozen_heap_frees_the_replaced_model(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], tmp_path: Path,
) -> None:
    runner = await _start(own_runner, write_copy(tmp_path / "served"))
    proxy = await make_proxy(the_runner=runner, watch_interval=60)
    tokenizer = runner._loaded.tokenizer
    # Many tokenizers and models hold reference cycles; the demo model's hold none, so one is
    # added: the replaced tokenizer can then only go by the cycle collector, never by
    # reference counting.
    tokenizer.cycle = tokenizer
    replaced = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    gc.freeze()  # as `cacheproxy serve` does once started: the model is in the frozen heap
    try:
        await proxy.app[INVALIDATOR].reload()
        assert proxy.app[INVALIDATOR].counters["reloads"] == 1
        assert gc.get_freeze_count() > 0  # frozen again, with the new model
        assert replaced() is None  # the old one was collected, not kept frozen
    finally:
        gc.unfreeze()


async def test_a_remembered_hit_is_not_served_across_a_reload(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], quantized: dict[int, Path],
    tmp_path: Path,
) -> None:
    runner, proxy = await _serving_q4(make_proxy, own_runner, quantized, tmp_path)
    old = runner.fingerprint().digest
    statuses = [(await _complete(proxy))[1]["X-Cache"] for _ in range(3)]
    assert statuses == ["MISS", "HIT", "HIT"]  # the last one from the remembered hit
    status, headers = await _during_a_reload_to_q8(proxy, quantized, tmp_path)  # a repeat
    assert status == 200 and headers["X-Cache"] == "MISS"
    assert headers["X-Cache-Fingerprint"] == runner.fingerprint().digest != old
    assert (await _complete(proxy))[1]["X-Cache"] == "HIT"


async def test_a_reload_longer_than_reload_wait_answers_503(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], tmp_path: Path,
) -> None:
    runner = await _start(own_runner, write_copy(tmp_path / "m"))
    proxy = await make_proxy(the_runner=runner, watch=False, reload_wait=0.01)
    # Hold the lane with a long generation so the reload queued behind it takes a while.
    long = {"prompt": "The owl", "max_tokens": 400,
            "logit_bias": {"0": -100, "2": -100}}
    async with aiohttp.ClientSession() as session:
        busy = asyncio.create_task(session.post(proxy.url + "/v1/completions", json=long))
        await asyncio.sleep(0.05)
        reload = asyncio.create_task(proxy.app[INVALIDATOR].reload())
        await asyncio.sleep(0)
        async with session.post(proxy.url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "overloaded"
        (await busy).release()
        await reload


async def test_two_engine_versions_serve_side_by_side_and_the_old_goes_after_its_grace(
    make_proxy: ProxyFactory, own_runner: list[MlxRunner], tmp_path: Path,
    start_redis: StartServer,
) -> None:
    """(#21) A rolling upgrade on one Redis: while both versions run, each replica answers HIT
    from its own namespace and neither is superseded (each holds a renewed lease); once the
    old replica stops, its namespace goes when the grace period has passed."""
    model = write_copy(tmp_path / "model")
    store = f"{start_redis().url}/0"
    timing = {"lease_ttl": 0.6, "supersede_grace": 1.0}  # renewed every 0.2 s
    old = await make_proxy(store=store, **timing, the_runner=await _start(
        own_runner, model, versions=lambda: EngineVersions("0.0.1", "0.0.1")))
    new = await make_proxy(store=store, **timing, the_runner=await _start(
        own_runner, model, versions=installed_versions))
    seen: dict[str, list[str]] = {"old": [], "new": []}
    started = asyncio.get_running_loop().time()
    # Past lease + grace + a renewal: a lease never renewed would have been superseded.
    while asyncio.get_running_loop().time() - started < 2.2:
        for name, proxy in (("old", old), ("new", new)):
            _, headers, _ = await _complete(proxy)
            seen[name].append(headers["X-Cache"])
        await asyncio.sleep(0.05)
    assert all(s[0] == "MISS" and set(s[1:]) == {"HIT"} for s in seen.values()), seen
    digests = {name: proxy.app[PROXY].runner.fingerprint().digest
               for name, proxy in (("old", old), ("new", new))}
    reports = {r.namespace.digest: r for r in await Registry(new.store).report()}
    assert [(reports[d].namespace.state, reports[d].replicas, reports[d].entries)
            for d in digests.values()] == [("current", 1, 1), ("current", 1, 1)]
    assert new.app[INVALIDATOR].counters["namespaces_purged"] == 0
    assert old.app[INVALIDATOR].counters["namespaces_purged"] == 0

    stopped = asyncio.get_running_loop().time()  # (before: stop() releases the lease first)
    await old.stop()
    await eventually(lambda: new.app[INVALIDATOR].counters["namespaces_purged"] == 1,
                     within=8, every=0.05)
    assert asyncio.get_running_loop().time() - stopped >= 1.0  # not before the grace
    await new.app[INVALIDATOR].idle()
    assert await _namespace_entries(new, digests["old"]) == 0
    reports = {r.namespace.digest: r for r in await Registry(new.store).report()}
    assert reports[digests["old"]].namespace.state == "superseded"
    assert (reports[digests["new"]].namespace.state, reports[digests["new"]].replicas) == \
        ("current", 1)


def _two_versions() -> tuple[list[float], Backend, Registry, fp.Fingerprint, fp.Fingerprint]:
    """A registry on a memory store with a settable clock, and the demo model's fingerprint
    under two engine versions."""
    now = [0.0]
    store = open_backend("memory://")
    registry = Registry(store, clock=lambda: now[0])
    return (now, store, registry, dataclasses.replace(FINGERPRINT_A, engine_version="1"),
            dataclasses.replace(FINGERPRINT_A, engine_version="2"))


async def test_a_replica_that_dies_keeps_its_namespace_until_lease_and_grace_lapse() -> None:
    """A crashed replica releases nothing: its lease lapses, then the grace period runs."""
    now, store, registry, a, b = _two_versions()
    assert await registry.observe(a, replica="r1", lease_ttl=30, grace=60) == []
    for t, superseded in ((10, []), (29, []), (31, []), (89, []), (91, [a.digest])):
        now[0] = t
        assert await registry.observe(b, replica="r2", lease_ttl=30, grace=60) == superseded, t
    await store.aclose()


async def test_a_live_lease_holds_its_namespace_whatever_the_grace() -> None:
    """With no grace at all, a namespace a live replica holds is not superseded (the lease
    alone keeps it); a replica whose files changed releases its lease without grace, and
    the namespace stays while another replica still holds one."""
    now, store, registry, a, b = _two_versions()
    assert await registry.observe(a, replica="r1", lease_ttl=30, grace=0) == []
    assert await registry.observe(a, replica="r3", lease_ttl=30, grace=0) == []
    now[0] = 10
    assert await registry.observe(b, replica="r2", lease_ttl=30, grace=0) == []  # r1, r3 live
    await registry.release(a.digest, "r1", replaced=True)  # r1's files became b
    assert await registry.observe(b, replica="r1", lease_ttl=30, grace=0) == []  # r3 still
    await registry.release(a.digest, "r3")
    assert await registry.observe(b, replica="r2", lease_ttl=30, grace=0) == [a.digest]
    await store.aclose()


class _Unlocked:
    """The same Redis store without its locks (the control: a store the registry cannot
    lock, as the registry was before #21's follow-up)."""

    def __init__(self, store: Backend) -> None:
        self.get, self.set, self.delete = store.get, store.set, store.delete


async def test_replicas_renewing_at_once_on_redis_lose_no_lease(
    start_redis: StartServer,
) -> None:
    """Every registry change is a read-modify-write: under the store's lock, 16 replicas
    (each with its own connection, as other processes) renewing at the same moment all keep
    their lease; the control, the same record on the same Redis without the lock, loses
    some."""
    url = f"{start_redis().url}/0"
    stores = [open_backend(url) for _ in range(16)]
    try:
        async def renew_all(registries: list[Registry]) -> int:
            await stores[0].delete(REGISTRY_KEY)
            await asyncio.gather(*(r.observe(FINGERPRINT_A, replica=f"r{i}", lease_ttl=30)
                                   for i, r in enumerate(registries)))
            return len((await Registry(stores[0]).load())[FINGERPRINT_A.digest].leases)

        assert await renew_all([Registry(s) for s in stores]) == 16
        unlocked = [Registry(_Unlocked(s)) for s in stores]  # type: ignore[arg-type]
        assert await renew_all(unlocked) < 16
    finally:
        for store in stores:
            await store.aclose()


async def test_a_tiered_replica_never_renews_from_its_stale_l1_copy_of_the_registry(
    start_redis: StartServer,
) -> None:
    """On tiered+redis the record is read in Redis, under the lock: a replica whose L1 holds
    an old copy (untracked, or the notice of the change still on its way) still keeps the
    other replica's lease. (The stale copy is put into L1 by hand: no real part holds one on
    cue.)"""
    url = f"{start_redis().url}/0"
    a_store, b_store = open_backend(f"tiered+{url}"), open_backend(f"tiered+{url}")
    assert isinstance(a_store, TieredBackend)
    try:
        a, b = Registry(a_store), Registry(b_store)
        await a.observe(FINGERPRINT_A, replica="ra", lease_ttl=30)
        stale = await a_store.l2.get(REGISTRY_KEY)
        assert stale is not None
        await b.observe(FINGERPRINT_A, replica="rb", lease_ttl=30)
        await a_store.l1.set(REGISTRY_KEY, stale)
        await a.observe(FINGERPRINT_A, replica="ra", lease_ttl=30)
        leases = (await Registry(b_store).load())[FINGERPRINT_A.digest].leases
        assert sorted(leases) == ["ra", "rb"]
    finally:
        await a_store.aclose()
        await b_store.aclose()


async def test_an_unreadable_registry_does_not_stop_a_release_or_a_newer_records_fields(
) -> None:
    store = open_backend("memory://")
    registry = Registry(store)
    await registry.observe(FINGERPRINT_A, replica="r1", lease_ttl=30, grace=0)
    namespaces = await registry.load()
    record = {d: {**dataclasses.asdict(n), "added_later": 1} for d, n in namespaces.items()}
    await store.set(REGISTRY_KEY, codec.encode_meta(record))
    assert list(await registry.load()) == [FINGERPRINT_A.digest]  # the new field ignored
    await store.set(REGISTRY_KEY, b"not a registry")
    invalidator = Invalidator(_Fixed(FINGERPRINT_A), store, policy=InvalidationPolicy.PURGE,
                              reload_wait=1)
    await invalidator._release(FINGERPRINT_A.digest)  # logged, not raised
    await store.aclose()


class _Fixed:
    """A runner stand-in that only has a fingerprint (the registry needs no model)."""

    model_dir = None

    def __init__(self, fingerprint: fp.Fingerprint) -> None:
        self._fingerprint = fingerprint

    def fingerprint(self) -> fp.Fingerprint:
        return self._fingerprint


async def test_two_models_behind_one_proxy_each_with_its_lane_namespace_and_reload(
    quantized: dict[int, Path], tmp_path: Path,
) -> None:
    """(#21) `--model demo=PATH --model q=PATH`: requests route by `model`, each model has
    its own fingerprint and entries; replacing one model's files reloads only that one."""
    demo, q = write_copy(tmp_path / "demo"), tmp_path / "q"
    shutil.copytree(quantized[4], q)
    settings = Settings(model=f"demo={demo},q={q}", store="memory://", watch_interval=0.1,
                        digest_memo=str(tmp_path / "digests.json"))
    server = TestServer(build_app(settings), host="127.0.0.1", port=free_port())
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session:
            ask = asker(session, url + "/v1/completions", BODY)
            first = await miss_then_hit(session, url, ask)
            async with session.post(url + "/v1/completions",
                                    json={**BODY, "model": "other"}) as resp:
                assert resp.status == 404

            for name in ("config.json", "model.safetensors"):  # q becomes the 8-bit model
                shutil.copy2(quantized[8] / name, q / name)

            async def states() -> dict[str, dict[str, object]]:
                async with session.get(url + "/health") as resp:
                    return {m["id"]: m for m in (await resp.json())["models"]}

            deadline = asyncio.get_running_loop().time() + 20
            while (await states())["q"]["fingerprint"] == first["q"][1]:
                assert asyncio.get_running_loop().time() < deadline, "q was not reloaded"
                await asyncio.sleep(0.1)
            now = await states()
            assert now["demo"]["fingerprint"] == first["demo"][1]
            assert now["demo"]["counters"]["reloads"] == 0  # type: ignore[index]
            assert now["q"]["counters"]["reloads"] == 1  # type: ignore[index]
            assert (await ask("demo"))[0] == "HIT" and (await ask("q"))[0] == "MISS"
            async with session.get(url + "/metrics") as resp:
                metrics = await resp.text()
            for line in ('cacheproxy_model_requests_total{cache="HIT",model="demo"} 2.0',
                         'cacheproxy_model_requests_total{cache="MISS",model="q"} 2.0'):
                assert line in metrics, metrics
    finally:
        await server.close()
