"""Exact prefix reuse for the in-process runner: KV states saved at multiples of the
prefill step, from which a miss's prefill continues bit-identically to a cold one.

mlx-lm's prefill (``generate_step``) cuts a prompt into chunks of ``prefill_step_size`` from
position 0, evaluates the KV cache after each, and leaves the last token to the first
decoding step. The state after k whole chunks is therefore the state every cold prefill of
a longer prompt with the same first k chunks passes through, bit for bit: continuing from
it runs the rest in the same chunks of the same shapes. So a miss saves its state at the
largest multiple of the step its prefill reached, and a later miss with that prefix starts
there. Nothing else is ever reused: not a state cut between two multiples, not one
computed in other chunks, never one that decoding wrote (one token at a time).

A saved state also serves any shorter aligned prefix of itself: its first j chunks are
exactly the state after j chunks, laid out again as the cold prefill lays them out.
Entries are bounded by bytes (least recently used first out) and belong to one loaded
model: a reload starts an empty store.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash


@dataclass(frozen=True, slots=True)
class Saved:
    """One saved state: each layer's keys and values as the cold prefill left them."""

    ids: tuple[int, ...]  # the prompt tokens it holds (checked, so no hash can collide)
    chain: tuple[bytes, ...]  # the chain hash after each of its chunks
    layers: tuple[tuple[Any, Any], ...]
    nbytes: int


def supports(cache: list[Any]) -> bool:
    """Whether a model's prompt cache is the plain KV cache this reuse knows how to cut.
    (Rotating, quantized and recurrent caches are not cut at a token boundary.)"""
    from mlx_lm.models.cache import KVCache

    return bool(cache) and all(type(c) is KVCache for c in cache)


class PrefixStore:
    """Saved states by the chain hash of their chunks; LRU, bounded by bytes."""

    def __init__(self, step: int, max_bytes: int) -> None:
        self.step = step
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Saved] = OrderedDict()  # by last hash, LRU first
        self._index: dict[bytes, bytes] = {}  # chain hash of any chunk -> entry holding it
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every saved state (the model they came from is being replaced)."""
        self._entries.clear()
        self._index.clear()
        self.bytes = 0

    def state(self) -> dict[str, int]:
        """Entries, bytes and the bound (for /health, /status.json and /admin/stats)."""
        return {"prefix_entries": len(self._entries), "prefix_bytes": self.bytes,
                "prefix_max_bytes": self.max_bytes, "prefix_step": self.step}

    def chain(self, ids: Sequence[int], length: int) -> list[bytes]:
        """The chain hash after each whole chunk of ``ids[:length]`` (a multiple)."""
        hashes: list[bytes] = []
        previous = b""
        for start in range(0, length, self.step):
            chunk = array("q", ids[start:start + self.step]).tobytes()
            previous = xxhash.xxh3_128_digest(previous + chunk)
            hashes.append(previous)
        return hashes

    def longest(self, ids: Sequence[int], chain: list[bytes]) -> tuple[Saved, int] | None:
        """The saved state holding the longest prefix of ``chain``, and that prefix's length
        in tokens."""
        for chunks in range(len(chain), 0, -1):
            owner = self._index.get(chain[chunks - 1])
            if owner is None:
                continue
            entry = self._entries[owner]
            length = chunks * self.step
            if entry.ids[:length] != tuple(ids[:length]):
                continue  # a hash collision: never reuse what is not the same tokens
            self._entries.move_to_end(owner)
            return entry, length
        return None

    def put(self, ids: Sequence[int], chain: list[bytes], layers: tuple[tuple[Any, Any], ...]
            ) -> None:
        """Save a state of ``len(chain)`` chunks; what it extends is dropped (it holds it)."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        last = chain[-1]
        if nbytes > self.max_bytes or last in self._entries:
            return
        for h in chain[:-1]:
            if h in self._entries:  # a shorter state of the same tokens: this one holds it
                self._drop(h)
        while self._entries and self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        length = len(chain) * self.step
        self._entries[last] = Saved(tuple(ids[:length]), tuple(chain), layers, nbytes)
        self.bytes += nbytes
        for h in chain:
            self._index[h] = last

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        lost = {h for h in entry.chain if self._index.get(h) == key}
        for h in lost:
            del self._index[h]
        # Another entry that shares some of these chunks still holds them: point to it.
        for other_key, other in self._entries.items():
            for h in other.chain:
                if h in lost:
                    self._index.setdefault(h, other_key)


def warm(store: PrefixStore, model: Any, cache: list[Any], ids: Sequence[int]) -> tuple[int, int]:
    """Bring ``cache`` (fresh) to the largest multiple of the step a cold prefill of ``ids``
    passes through, from the longest saved prefix; save the state reached. Returns (tokens
    taken from a saved state, tokens the cache now holds)."""
    step = store.step
    aligned = (len(ids) - 1) // step * step  # generate_step keeps the last token back
    if aligned <= 0:
        return 0, 0
    chain = store.chain(ids, aligned)
    found = store.longest(ids, chain)
    reused = 0
    if found is not None:
        entry, reused = found
        _restore(cache, entry, reused, step)
    prefill(model, cache, ids[reused:aligned], step)
    if aligned > reused:
        store.put(ids, chain, tuple(_copy(c) for c in cache))
    return reused, aligned


def prefill(model: Any, cache: list[Any], ids: Sequence[int], step: int) -> None:
    """Whole chunks of ``step`` tokens through the model, exactly as ``generate_step``'s
    prefill runs them (same stream, an evaluation and a buffer release after each)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        for start in range(0, len(ids), step):
            model(mx.array(list(ids[start:start + step]))[None], cache=cache)
            mx.eval([c.state for c in cache])
            mx.clear_cache()


def with_history(processors: list[Any], prefix: Sequence[int]) -> list[Any]:
    """The logits processors of a resumed generation, given the token history a cold run
    gives them (``generate_step`` passes only the tokens it was handed)."""
    if not processors or not prefix:
        return processors
    import mlx.core as mx

    head = mx.array(list(prefix))

    def processed(tokens: Any, logits: Any) -> Any:
        history = mx.concatenate([head, tokens])
        for processor in processors:
            logits = processor(history, logits)
        return logits

    return [processed]


def _copy(layer: Any) -> tuple[Any, Any]:
    """A layer's buffers as new arrays: the cache writes into its own in place."""
    import mlx.core as mx

    return mx.array(layer.keys), mx.array(layer.values)


def _restore(cache: list[Any], entry: Saved, length: int, step: int) -> None:
    """Each layer of ``cache`` at ``length`` tokens of ``entry``, laid out as a cold prefill
    of ``length`` tokens lays it out (buffer size included, zeros past the end)."""
    import mlx.core as mx

    size = cold_buffer(length, step, type(cache[0]).step)
    for layer, (keys, values) in zip(cache, entry.layers, strict=True):
        if length == len(entry.ids):  # the saved state itself (new arrays: see _copy)
            layer.state = (mx.array(keys), mx.array(values), length)
            continue
        layer.state = (_cut(keys, length, size), _cut(values, length, size), length)


def _cut(buffer: Any, length: int, size: int) -> Any:
    import mlx.core as mx

    kept = buffer[..., :length, :]
    if size == length:
        return mx.contiguous(kept)
    shape = (*buffer.shape[:2], size - length, buffer.shape[3])
    return mx.concatenate([kept, mx.zeros(shape, buffer.dtype)], axis=2)


def cold_buffer(length: int, step: int, grow: int) -> int:
    """The size of mlx-lm's KVCache buffer after a cold prefill of ``length`` tokens in
    chunks of ``step`` (it grows in whole blocks of ``grow``, trimmed to the end when the
    end is not on a block)."""
    size = done = 0
    while done < length:
        n = min(step, length - done)
        if done + n > size:
            if size and done % grow:
                size = done
            size += (grow + n - 1) // grow * grow
        done += n
    return size
