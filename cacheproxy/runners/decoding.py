"""What one decoding step of the in-process runner needs: the sampler, the logits
processors of a request (penalties, logit bias) and a token's log-probabilities."""

from __future__ import annotations

import os
from typing import Any, cast

from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.codec import TokenLogprob


def sampling(request: CanonicalRequest) -> tuple[Any, list[Any]]:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    s = request.sampling
    if not s.is_greedy and s.seed is not None:
        # Seeded on the one lane, batch of one: the sampled answer is reproducible.
        mx.random.seed(s.seed % 2**64)
    sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0,
                           min_p=s.min_p, top_k=s.top_k)
    return sampler, processors(request)


def processors(request: CanonicalRequest) -> list[Any]:
    """The logits processors of a request: logit bias and penalties (mlx-lm's)."""
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(
        logit_bias=dict(request.logit_bias) or None,
        repetition_penalty=request.repetition_penalty if request.repetition_penalty != 1 else None,
        presence_penalty=request.presence_penalty or None,
        frequency_penalty=request.frequency_penalty or None,
    )


def logprob(tokenizer: Any, token: int, logprobs: Any, top: int) -> TokenLogprob:
    import mlx.core as mx

    decode = tokenizer.decode
    alternatives: tuple[tuple[int, str, float], ...] = ()
    if top:
        ids = cast(list[int], mx.argsort(-logprobs)[:top].tolist())
        alternatives = tuple((i, decode([i]), float(logprobs[i].item())) for i in ids)
    return TokenLogprob(token, decode([token]), float(logprobs[token].item()), alternatives)


class KeyedSampler:
    """The sampler of one generation in a pinned batch: greedy, or mlx-lm's filters then a
    draw from the generation's own random key (split per step), never the global seed, so
    a sample never depends on its neighbours or on their order."""

    def __init__(self, request: CanonicalRequest) -> None:
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        s = request.sampling
        self._temp = s.temperature
        self._greedy = s.is_greedy
        self._filters: list[Any] = []
        if 0 < s.top_p < 1:
            self._filters.append(lambda x: apply_top_p(x, s.top_p))
        if s.min_p != 0.0:
            self._filters.append(lambda x: apply_min_p(x, s.min_p))
        if s.top_k > 0:
            self._filters.append(lambda x: apply_top_k(x, s.top_k))
        seed = s.seed if s.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._key = mx.random.key(seed % 2**64)

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx

        if self._greedy:
            return mx.argmax(logprobs, axis=-1)
        for method in self._filters:
            logprobs = method(logprobs)
        self._key, step = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self._temp), key=step)
