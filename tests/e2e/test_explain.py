"""service/explain: the same request stored under another namespace (the producer changed)
is found there; the scan of the nearest entries stops at its bound and says so."""

from __future__ import annotations

from backends.memory import MemoryBackend
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest, parse
from cacheproxy.keys.key import make_key
from cacheproxy.service.explain import explain
from cacheproxy.service.namespaces import Namespace, Registry
from policies.sampling import SamplingMode
from tests.unit.keys.test_structured_keys import DEFAULTS

OLD, NEW = "a" * 32, "b" * 32


def request(content: str) -> CanonicalRequest:
    return parse({"messages": [{"role": "user", "content": content}], "max_tokens": 5},
                 "chat", DEFAULTS, SamplingMode.FORCE_GREEDY).request


def record(content: str) -> bytes:
    output = codec.Output(chunks=(codec.Chunk("x", (1,)),), finish_reason="stop",
                          prompt_tokens=1, completion_tokens=1)
    return codec.encode(codec.Record(request=request(content).wire(), output=output,
                                     provenance={}))


def namespace(digest: str, state: str) -> Namespace:
    return Namespace(digest=digest, model_id="demo", fields={}, first_seen=0.0,
                     last_seen=0.0, state=state)


async def test_another_namespace_holding_the_request_and_a_bounded_scan() -> None:
    store = MemoryBackend()
    await Registry(store).save({OLD: namespace(OLD, "superseded"),
                                NEW: namespace(NEW, "current")})
    await store.set(make_key(request("fox"), OLD), record("fox"))
    for i in range(5):
        await store.set(make_key(request(f"cat {i}"), NEW), record(f"cat {i}"))
    moved = await explain(store, request("fox"), NEW)
    assert not moved.stored and moved.elsewhere == ((OLD, "superseded"),)
    assert moved.complete and moved.scanned == 5
    assert moved.nearest[0].differences == ("messages[0].content",)
    bounded = await explain(store, request("fox"), NEW, scan=2)
    assert (bounded.scanned, bounded.complete) == (2, False)
    # Control: a request stored in its own namespace is a HIT, looked up once.
    held = await explain(store, request("cat 3"), NEW)
    assert held.stored and held.elsewhere == () and held.scanned == 0
