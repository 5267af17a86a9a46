"""Attention per row: the seam that lets S generations decode in one forward pass while
every row's bits stay those of its own generation.

A decode step runs the model once on an (S, 1) batch. Everything but attention works on
rows independently (projections, norms, MLP, RoPE with per-row offsets); at a pinned S a
row's bits then never depend on what the other rows hold (measured on batch-variant BLAS:
/work/shared/experiments). Attention is the one op that mixes a row with its own history,
and its histories differ in length, so it runs per row: row i's query against the keys and
values of row i's own KV cache, exactly the op a lone decode runs. No padding, no mask.

The seam is mlx-lm's own: every model module calls ``scaled_dot_product_attention`` (from
``mlx_lm.models.base``) with the layer's cache object, and takes RoPE offsets from
``cache.offset``. A `RowsCache` is that cache object for one layer of the batch, and
`install` makes the module's ``scaled_dot_product_attention`` hand a `RowsCache` to its
per-row attention (any other cache goes to mlx-lm's function unchanged). `check` refuses a
model that does not go through this seam in every layer: never a silent fallback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

SETTING = "decode_slots"
SDPA = "scaled_dot_product_attention"  # the name each mlx-lm model module imports


class UnsupportedModel(ValueError):
    """A model whose decoding the pinned batch cannot run per row (names the setting)."""


class RowsCache:
    """One layer's cache for a decode step of S rows: row i writes into ``rows[i]`` (a
    slot's own mlx-lm KVCache of this layer), None for a free row (its values are dropped)."""

    def __init__(self, rows: Sequence[Any]) -> None:
        import mlx.core as mx

        self.rows = list(rows)
        # Per-row RoPE offsets, as mlx-lm's BatchKVCache gives them (read before the update).
        self.offset = mx.array([0 if c is None else c.offset for c in self.rows], mx.int32)
        self._fetched: list[tuple[Any, Any] | None] = []
        self.attended = 0  # per-row attentions run through this layer (`check` counts them)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Write each row's new keys and values into its slot's cache; the attention of this
        layer reads them back per row (what is returned is only passed on to it)."""
        import mlx.core as mx

        n = len(self.rows)  # (one split of each, not a slice per row: fewer ops per step)
        rows_keys, rows_values = mx.split(keys, n, axis=0), mx.split(values, n, axis=0)
        self._fetched = [None if c is None else c.update_and_fetch(rows_keys[i], rows_values[i])
                         for i, c in enumerate(self.rows)]
        return keys, values

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> None:
        """No mask: one new token per row, attending to its whole own history."""
        if n != 1:
            raise UnsupportedModel("a pinned decode step takes one token per row")

    def attend(self, queries: Any, scale: float, sinks: Any) -> Any:
        """Attention of each row at its own length; zeros for a free row."""
        import mlx.core as mx

        self.attended += 1
        _, heads, length, _ = queries.shape
        rows_queries = mx.split(mx.contiguous(queries), len(self._fetched), axis=0)
        free = None  # one zero row serves every free row
        out = []
        for i, kv in enumerate(self._fetched):
            if kv is None:
                if free is None:
                    free = mx.zeros((1, heads, length, kv_dim(self._fetched)), queries.dtype)
                out.append(free)
                continue
            keys, values = kv
            extra = {} if sinks is None else {"sinks": sinks}
            out.append(mx.fast.scaled_dot_product_attention(
                rows_queries[i], keys, values, scale=scale, mask=None, **extra))
        return mx.concatenate(out, axis=0)


def kv_dim(fetched: Sequence[tuple[Any, Any] | None]) -> int:
    """The value head size of the rows in use (a free row's output has its shape)."""
    return int(next(kv[1].shape[-1] for kv in fetched if kv is not None))


def attention(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
              sinks: Any = None) -> Any:
    """mlx-lm's ``scaled_dot_product_attention``, per row for a `RowsCache`."""
    if isinstance(cache, RowsCache):
        return cache.attend(queries, scale, sinks)
    from mlx_lm.models.base import scaled_dot_product_attention

    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                        mask=mask, sinks=sinks)


def install(model: Any) -> int:
    """Route the attention of every module of ``model`` that uses mlx-lm's function through
    `attention`; returns how many modules do. Idempotent, and a no-op for other caches."""
    from mlx_lm.models import base

    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if type(m).__module__ in sys.modules}
    routed = 0
    for module in modules:
        if getattr(module, SDPA, None) is base.scaled_dot_product_attention:
            setattr(module, SDPA, attention)
        if getattr(module, SDPA, None) is attention:
            routed += 1
    return routed


def check(model: Any, slots: int) -> None:
    """Refuse (`UnsupportedModel`, naming the setting) a model whose every layer does not
    decode through `RowsCache` and per-row attention, or whose rows do not come out as a
    lone decode's (to rounding): two rows of other lengths, one step each way."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    if not cache or not all(type(c) is KVCache for c in cache):
        kinds = sorted({type(c).__name__ for c in cache})
        raise UnsupportedModel(f"invalid value for setting '{SETTING}': {slots}: this model's "
                               f"cache ({', '.join(kinds)}) is not mlx-lm's plain KVCache; "
                               "serve it with --decode-slots 1")
    install(model)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [7, 3, 5]]
    caches, lone = [], []
    for ids in prompts:
        row_cache = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=row_cache)
        solo = make_prompt_cache(model)
        for mine, theirs in zip(solo, row_cache, strict=True):
            mine.state = (mx.array(theirs.keys), mx.array(theirs.values), theirs.offset)
        lone.append(model(mx.array(ids[-1:])[None], cache=solo)[0, -1])
        caches.append(row_cache)
    rows = [*caches, *([None] * (max(slots, 2) - 2))]
    layers = [RowsCache([c if c is None else c[n] for c in rows]) for n in range(len(cache))]
    inputs = mx.array([[p[-1]] for p in prompts] + [[0]] * (len(rows) - 2))
    try:
        logits = model(inputs, cache=layers)[:, -1]
    except Exception as exc:  # an architecture that reads its cache otherwise
        raise UnsupportedModel(f"invalid value for setting '{SETTING}': {slots}: this model "
                               f"cannot decode in a pinned batch ({type(exc).__name__}: "
                               f"{exc}); serve it with --decode-slots 1") from exc
    if any(layer.attended != 1 for layer in layers):
        raise UnsupportedModel(f"invalid value for setting '{SETTING}': {slots}: this model's "
                               "attention does not go through mlx-lm's "
                               "scaled_dot_product_attention in every layer; serve it with "
                               "--decode-slots 1")
    for i, alone in enumerate(lone):
        # (a NaN logit is the model's, alone as in a batch: not a reason to refuse S)
        finite = mx.where(mx.isfinite(alone), mx.abs(alone), 0.0)  # (an inf: no bound)
        bound = 1e-2 * (1.0 + float(finite.max().tolist()))  # type: ignore[arg-type]
        if not mx.allclose(logits[i], alone, rtol=1e-2, atol=bound, equal_nan=True).item():
            raise UnsupportedModel(f"invalid value for setting '{SETTING}': {slots}: this "
                                   "model's rows decode otherwise in a batch than alone; "
                                   "serve it with --decode-slots 1")
    pinned(model, slots)


PROBE = (3, 1, 4, 1, 5, 9, 2, 6)  # a prompt every row of the probe's first step holds


def pinned(model: Any, slots: int) -> None:
    """Refuse (`UnsupportedModel`, naming the setting) an S at which, on this runtime, a
    row's bits depend on the row it is in or on what the other rows hold. The pinned shape
    only makes the matrix products' shapes fixed; how a BLAS treats the rows of one shape
    is its own, and the CPU's (measured on one EPYC: OpenBLAS on one thread gave a 16-row
    product other bits in some rows than in row 0, on two threads it did not, at 8 rows
    neither did; on another EPYC no row moved at any count). Two steps of S
    rows: every row holding the same prompt must come out bit-equal to row 0, and row 0
    must keep those bits when the other rows hold other prompts."""
    import mlx.core as mx

    same = _step(model, [list(PROBE)] * slots)
    if not mx.isfinite(same[0]).any().item():  # NaN == NaN in every row would prove nothing
        raise UnsupportedModel(
            f"invalid value for setting '{SETTING}': {slots}: this model's logits are not "
            "finite (NaN or inf) for the start-up probe, so whether its rows keep their bits "
            "in a pinned batch cannot be checked; serve it with --decode-slots 1")
    moved = [i for i in range(1, slots)
             if not mx.array_equal(same[i], same[0], equal_nan=True).item()]
    if moved:
        raise UnsupportedModel(
            f"invalid value for setting '{SETTING}': {slots}: on this runtime a row of a "
            f"{slots}-row decode step gets other bits in row {moved[0]} than in row 0 (the "
            "BLAS treats the rows of this shape apart), so an answer would depend on the row "
            "it lands in; choose another --decode-slots (8 is often invariant) or another "
            "BLAS thread count, or serve with --decode-slots 1")
    others = [list(PROBE)] + [[PROBE[(i + j) % len(PROBE)] for j in range(1 + i % 6)]
                              for i in range(1, slots)]  # other prompts, other lengths
    beside = _step(model, others)
    if not mx.array_equal(beside[0], same[0], equal_nan=True).item():
        raise UnsupportedModel(
            f"invalid value for setting '{SETTING}': {slots}: on this runtime a row of a "
            f"{slots}-row decode step gets other bits beside other rows, so an answer would "
            "depend on its neighbours; serve with --decode-slots 1")


def _step(model: Any, prompts: Sequence[Sequence[int]]) -> Any:
    """The logits of one pinned decode step, row i continuing ``prompts[i]`` (each prefilled
    alone, its last token fed to the step)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for ids in prompts:
        cache = make_prompt_cache(model)
        if len(ids) > 1:
            model(mx.array(list(ids[:-1]))[None], cache=cache)
        caches.append(cache)
    layers = [RowsCache([c[n] for c in caches]) for n in range(len(caches[0]))]
    logits = model(mx.array([[ids[-1]] for ids in prompts]), cache=layers)[:, -1]
    mx.eval(logits)
    return logits
