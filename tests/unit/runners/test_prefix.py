"""The prefix store of exact prefix reuse (runners/prefix.py): longest saved prefix, own
copies, hash collisions, the byte bound, shared chunks, eviction order, mlx-lm's buffer size;
and the prefill step pinned in the fingerprint."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from cacheproxy.cli.settings import DEMO_MODEL_ID
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import local_fingerprint
from cacheproxy.runners.prefix import PrefixStore, cold_buffer


def test_the_prefill_step_is_pinned_and_the_reuse_setting_is_not() -> None:
    at_512 = local_fingerprint(DEMO_MODEL_ID, BUNDLED_MODEL)
    assert at_512.prefill_step == 512
    assert local_fingerprint(DEMO_MODEL_ID, BUNDLED_MODEL, prefill_step=256).digest != \
        at_512.digest
    # (prefix_cache_bytes is a runner option only: nothing of it reaches the fingerprint.)
    assert "prefix" not in " ".join(at_512.fields())


def _layers(tokens: int, layers: int = 2, fill: float = 0.0) -> tuple[tuple[Any, Any], ...]:
    import mlx.core as mx

    return tuple((mx.full((1, 2, tokens, 4), fill), mx.full((1, 2, tokens, 4), fill))
                 for _ in range(layers))


# One chunk of 4 tokens, 2 layers: its keys and values, and its token ids (int64).
CHUNK = sum(k.nbytes + v.nbytes for k, v in _layers(4)) + 4 * 8


def test_the_store_finds_the_longest_saved_prefix() -> None:
    store = PrefixStore(step=4, max_bytes=1 << 20)
    a = list(range(100, 120))  # 20 tokens: 5 chunks
    store.put(a, store.chain(a, 16), _layers(16))
    b = a[:8] + [7, 7, 7, 7, 7, 7, 7, 7, 7]  # shares two chunks
    found = store.longest(b, store.chain(b, 16))
    assert [c.ids for c in found] == [array("q", a[:4]).tobytes(), array("q", a[4:8]).tobytes()]
    assert store.longest([1, 2, 3, 4, 5], store.chain([1, 2, 3, 4, 5], 4)) == []
    # A longer state of the same tokens adds only the chunk it does not share.
    store.put(a, store.chain(a, 20), _layers(20))
    assert len(store) == 5 and store.bytes == 5 * CHUNK
    assert len(store.longest(a, store.chain(a, 12))) == 3


def test_a_scope_reuses_only_its_own_chunks() -> None:
    """Per-key scope (#34): the same tokens saved by tenant "a" are no prefix of tenant
    "b"'s prompt nor of the shared scope's; each scope holds its own copy."""
    store = PrefixStore(step=4, max_bytes=1 << 20)
    a = list(range(100, 112))
    store.put(a, store.chain(a, 8, "a"), _layers(8), "a")
    assert len(store.longest(a, store.chain(a, 8, "a"), "a")) == 2
    assert store.longest(a, store.chain(a, 8, "b"), "b") == []
    assert store.longest(a, store.chain(a, 8), "") == []
    # Even handed tenant a's chain hashes, tenant b finds nothing (the scope is checked).
    assert store.longest(a, store.chain(a, 8, "a"), "b") == []
    store.put(a, store.chain(a, 8, "b"), _layers(8), "b")
    assert len(store) == 4 and len(store.longest(a, store.chain(a, 8, "b"), "b")) == 2


def test_a_saved_chunk_is_its_own_copy_of_the_cache() -> None:
    """A chunk holds its own buffer, not a view that would keep the whole cache alive."""
    import mlx.core as mx

    store = PrefixStore(step=4, max_bytes=1 << 30)
    ids = list(range(4096 + 1))
    mx.clear_cache()
    before = mx.get_active_memory()
    big = mx.arange(8 * 4096 * 64, dtype=mx.float32).reshape(1, 8, 4096, 64)  # 8 MiB
    mx.eval(big)
    store.put(ids[:5], store.chain(ids, 4), [(big, big)])
    del big
    mx.clear_cache()
    assert mx.get_active_memory() - before < 1 << 20, "the saved chunk keeps the cache's buffer"
    (chunk,) = store.longest(ids, store.chain(ids, 4))
    expected = mx.arange(8 * 4096 * 64, dtype=mx.float32).reshape(1, 8, 4096, 64)[..., :4, :]
    assert mx.array_equal(chunk.layers[0][0], expected).item()
    assert chunk.layers[0][0].shape == (1, 8, 4, 64)


def test_a_hash_collision_never_stores_over_other_tokens() -> None:
    store = PrefixStore(step=4, max_bytes=1 << 20)
    a, b = [1, 2, 3, 4, 5], [9, 9, 9, 9, 5]
    store.put(a, store.chain(a, 4), _layers(4))
    store.put(b, store.chain(a, 4), _layers(4, fill=1.0))  # b's tokens under a's hash
    assert len(store) == 1 and store.bytes == CHUNK
    (kept,) = store.longest(a, store.chain(a, 4))
    assert kept.ids == array("q", a[:4]).tobytes()


def test_a_hash_collision_never_reuses_other_tokens() -> None:
    store = PrefixStore(step=4, max_bytes=1 << 20)
    a, b = [1, 2, 3, 4, 5], [9, 9, 9, 9, 5]
    store.put(a, store.chain(a, 4), _layers(4))
    assert store.longest(b, store.chain(a, 4)) == []  # b's tokens under a's hash


def test_the_store_is_bounded_by_bytes_least_recently_used_first() -> None:
    store = PrefixStore(step=4, max_bytes=2 * CHUNK)
    prompts = [[n] * 5 for n in range(3)]
    for p in prompts[:2]:
        store.put(p, store.chain(p, 4), _layers(4))
    assert store.longest(prompts[0], store.chain(prompts[0], 4))  # now the most recent
    store.put(prompts[2], store.chain(prompts[2], 4), _layers(4))
    assert len(store) == 2 and store.bytes == 2 * CHUNK
    assert store.longest(prompts[1], store.chain(prompts[1], 4)) == []  # the oldest went
    assert store.longest(prompts[0], store.chain(prompts[0], 4))
    # A prompt longer than the bound keeps the chunks that fit, from its first.
    store.put([5] * 40, store.chain([5] * 40, 36), _layers(36))
    assert len(store) == 2 and len(store.longest([5] * 40, store.chain([5] * 40, 36))) == 2


def test_conversations_with_one_system_prompt_hold_its_chunks_once() -> None:
    """(#18) Ten users, one 8-chunk system prompt, a chunk of their own each: 8 + 10 chunks,
    not 10 x 9; and eviction takes a user's own chunk before the shared ones."""
    store = PrefixStore(step=4, max_bytes=18 * CHUNK)
    system = list(range(32))
    users = [system + [1000 + u] * 4 + [0] for u in range(10)]
    for ids in users:
        store.put(ids, store.chain(ids, 36), _layers(36))
    assert len(store) == 18 and store.bytes == 18 * CHUNK
    other = system + [7] * 4 + [0]
    store.put(other, store.chain(other, 36), _layers(36))  # one more: the oldest user's goes
    assert len(store) == 18
    assert len(store.longest(users[0], store.chain(users[0], 36))) == 8  # shared ones stay
    assert all(len(store.longest(ids, store.chain(ids, 36))) == 9 for ids in users[1:])


def test_a_chunk_is_evicted_only_once_nothing_extends_it() -> None:
    store = PrefixStore(step=4, max_bytes=3 * CHUNK)
    a, b = [1] * 8 + [2] * 5, [1] * 8 + [3] * 5  # two branches of two common chunks
    store.put(a, store.chain(a, 12), _layers(12))
    store.put(b, store.chain(b, 12), _layers(12))  # 4 chunks > 3: a's own one goes
    assert len(store) == 3
    assert len(store.longest(a, store.chain(a, 12))) == 2
    assert len(store.longest(b, store.chain(b, 12))) == 3


@pytest.mark.parametrize("step", [16, 32, 100, 256, 300, 512])
def test_cold_buffer_is_the_size_mlx_lm_grows_its_cache_to(step: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    for done in range(0, 1200, step):
        n = min(step, 1200 - done)
        cache.update_and_fetch(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))
        assert cache.keys is not None
        assert cold_buffer(done + n, step, KVCache.step) == cache.keys.shape[2]
