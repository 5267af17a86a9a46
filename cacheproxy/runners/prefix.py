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

The saved states share their chunks: each chunk's keys and values are kept once, under
the chain hash of it and every chunk before it, so N conversations that open with one long
system prompt hold its chunks once, and a state is any path of chunks from the first. The
store is bounded by bytes; the least recently used chunk that no other extends goes first.
Chunks belong to one loaded model: a reload starts an empty store.

Every chunk belongs to a scope (a tenant under `--cache-scope per-key`, "" when shared): its
chain starts from the scope, and a chunk is reused only by a prompt of its own scope, so
one tenant's reuse (which a response reports) never tells it what another tenant sent.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import xxhash

T = TypeVar("T")


@dataclass(slots=True)
class Chunk:
    """One chunk of a saved state: each layer's keys and values for its `step` tokens."""

    parent: bytes  # the chain hash of the chunks before it (b"" for the first)
    scope: str  # whose prompts may reuse it (checked: a tenant never reuses another's)
    ids: bytes  # its tokens, as int64 (checked, so no hash collision is ever reused)
    layers: tuple[tuple[Any, Any], ...]
    nbytes: int  # its keys, values and ids
    children: int = 0  # stored chunks that extend it (it goes only once none does)


def supports(cache: list[Any]) -> bool:
    """Whether a model's prompt cache is the plain KV cache this reuse knows how to cut.
    (Rotating, quantized and recurrent caches are not cut at a token boundary.)"""
    from mlx_lm.models.cache import KVCache

    return bool(cache) and all(type(c) is KVCache for c in cache)


class PrefixStore:
    """Saved chunks by chain hash; bounded by bytes, least recently used leaf first out.

    A chunk is touched after the chunks that extend it (a path is touched from its end to
    its start), so a chunk is always more recent than its children and the least recent
    chunk of all is one that nothing extends: evicting from the front never orphans one."""

    def __init__(self, step: int, max_bytes: int) -> None:
        self.step = step
        self.max_bytes = max_bytes
        self._chunks: OrderedDict[bytes, Chunk] = OrderedDict()  # least recent first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def clear(self) -> None:
        """Drop every saved chunk (the model they came from is being replaced)."""
        self._chunks.clear()
        self.bytes = 0

    def state(self) -> dict[str, int]:
        """Chunks, bytes and the bound (for /health, /status.json and /admin/stats)."""
        return {"prefix_entries": len(self._chunks), "prefix_bytes": self.bytes,
                "prefix_max_bytes": self.max_bytes, "prefix_step": self.step}

    def chain(self, ids: Sequence[int], length: int, scope: str = "") -> list[bytes]:
        """The chain hash after each whole chunk of ``ids[:length]`` (a multiple), in
        ``scope`` (its chunks hash apart from every other scope's)."""
        hashes: list[bytes] = []
        previous = xxhash.xxh3_128_digest(b"scope\0" + scope.encode()) if scope else b""
        for start in range(0, length, self.step):
            previous = xxhash.xxh3_128_digest(previous + self._tokens(ids, start))
            hashes.append(previous)
        return hashes

    def _tokens(self, ids: Sequence[int], start: int) -> bytes:
        return array("q", ids[start:start + self.step]).tobytes()

    def longest(self, ids: Sequence[int], chain: list[bytes], scope: str = "") -> list[Chunk]:
        """The saved chunks of ``scope`` of the longest saved prefix of ``chain`` (marked as
        used)."""
        found: list[Chunk] = []
        parent = b""
        for i, h in enumerate(chain):
            chunk = self._chunks.get(h)
            if chunk is None or chunk.parent != parent or chunk.scope != scope or \
                    chunk.ids != self._tokens(ids, i * self.step):
                break  # (a hash collision: never reuse what is not the same tokens, or
                # another scope's)
            found.append(chunk)
            parent = h
        self._touch(chain[:len(found)])
        return found

    def put(self, ids: Sequence[int], chain: list[bytes],
            layers: Sequence[tuple[Any, Any]], scope: str = "") -> None:
        """Save the chunks of ``chain`` (of ``scope``) not saved yet, cut from ``layers``
        (each layer's keys and values buffers, holding at least ``len(chain)`` chunks), as
        far as the bound allows; the chunks already saved are marked as used."""
        import mlx.core as mx

        kept = len(self.longest(ids, chain, scope))
        path = sum(c.nbytes for c in (self._chunks[h] for h in chain[:kept]))
        for i in range(kept, len(chain)):
            if chain[i] in self._chunks:
                break  # other tokens under this hash (a collision): leave them, save no more
            start, end = i * self.step, (i + 1) * self.step
            cut = tuple((mx.contiguous(k[..., start:end, :]), mx.contiguous(v[..., start:end, :]))
                        for k, v in layers)
            tokens = self._tokens(ids, start)
            nbytes = sum(k.nbytes + v.nbytes for k, v in cut) + len(tokens)
            if path + nbytes > self.max_bytes:
                break  # the rest of this prompt does not fit, even alone
            while self.bytes + nbytes > self.max_bytes:
                self._evict()
            mx.eval(cut)  # its own buffers: not views that keep the whole cache alive
            parent = chain[i - 1] if i else b""
            self._chunks[chain[i]] = Chunk(parent, scope, tokens, cut, nbytes)
            if parent:
                self._chunks[parent].children += 1
            self.bytes += nbytes
            path += nbytes
            self._touch(chain[:i + 1])

    def _touch(self, path: list[bytes]) -> None:
        for h in reversed(path):  # the end first: a chunk stays more recent than its children
            self._chunks.move_to_end(h)

    def _evict(self) -> None:
        _, chunk = self._chunks.popitem(last=False)  # a leaf: see the class's docstring
        self.bytes -= chunk.nbytes
        if chunk.parent in self._chunks:
            self._chunks[chunk.parent].children -= 1


def warm(store: PrefixStore, model: Any, cache: list[Any], ids: Sequence[int],
         scope: str = "") -> tuple[int, int]:
    """Bring ``cache`` (fresh) to the largest multiple of the step a cold prefill of ``ids``
    passes through, from the longest prefix ``scope`` saved; save the chunks reached (as
    ``scope``'s). Returns (tokens taken from saved chunks, tokens the cache now holds)."""
    return drain(warming(store, model, cache, ids, scope))


def saved(store: PrefixStore, ids: Sequence[int],
          scope: str = "") -> tuple[int, list[bytes], list[Chunk]]:
    """The largest multiple of the step a cold prefill of ``ids`` passes through (0: none),
    the chain hashes up to it, and the saved chunks of ``scope``'s longest saved prefix of
    them (marked as used)."""
    aligned = (len(ids) - 1) // store.step * store.step  # generate_step keeps the last back
    if aligned <= 0:
        return 0, [], []
    chain = store.chain(ids, aligned, scope)
    return aligned, chain, store.longest(ids, chain, scope)


def warming(store: PrefixStore, model: Any, cache: list[Any],
            ids: Sequence[int], scope: str = "") -> Generator[int, None, tuple[int, int]]:
    """`warm`, one chunk of the model at a time: it yields each chunk's size before it runs
    it (so the one that runs the last chunk ends); its value is warm's."""
    step = store.step
    aligned, chain, found = saved(store, ids, scope)
    if aligned <= 0:
        return 0, 0
    reused = len(found) * step
    if found:
        restore(cache, found, step)
    yield from prefilling(model, cache, ids[reused:aligned], step)
    if aligned > reused:
        store.put(ids, chain, [(c.keys, c.values) for c in cache], scope)
    return reused, aligned


def prefill(model: Any, cache: list[Any], ids: Sequence[int], step: int) -> None:
    """Chunks of ``step`` tokens through the model, exactly as ``generate_step``'s
    prefill runs them (same stream, an evaluation and a buffer release after each)."""
    drain(prefilling(model, cache, ids, step))


def prefilling(model: Any, cache: list[Any], ids: Sequence[int],
               step: int) -> Generator[int, None, None]:
    """`prefill`, yielding each chunk's size before it runs it."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    for start in range(0, len(ids), step):
        yield min(step, len(ids) - start)
        with mx.stream(generation_stream):
            model(mx.array(list(ids[start:start + step]))[None], cache=cache)
            mx.eval([c.state for c in cache])
            mx.clear_cache()


def drain(steps: Generator[int, None, T]) -> T:
    """Run a chunked computation to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(T, done.value)


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


def restore(cache: list[Any], chunks: list[Chunk], step: int) -> None:
    """Each layer of ``cache`` at the tokens of ``chunks``, laid out as a cold prefill of
    that many tokens lays it out (buffer size included, zeros past the end)."""
    import mlx.core as mx

    length = len(chunks) * step
    size = cold_buffer(length, step, type(cache[0]).step)
    for n, layer in enumerate(cache):
        keys = [c.layers[n][0] for c in chunks]
        values = [c.layers[n][1] for c in chunks]
        if size > length:
            pad = (*keys[0].shape[:2], size - length, keys[0].shape[3])
            keys.append(mx.zeros(pad, keys[0].dtype))
            values.append(mx.zeros((*pad[:3], values[0].shape[3]), values[0].dtype))
        # Always new arrays (a concatenation, or a copy of one chunk): the cache writes into
        # its buffers in place, and the saved chunks must stay as they are.
        layer.state = (mx.concatenate(keys, axis=2) if len(keys) > 1 else mx.array(keys[0]),
                       mx.concatenate(values, axis=2) if len(values) > 1 else
                       mx.array(values[0]), length)


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
