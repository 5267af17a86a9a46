"""What one decoding step of the in-process runner needs: the sampler, the logits
processors of a request (penalties, logit bias) and a token's log-probabilities."""

from __future__ import annotations

from typing import Any, cast

from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.codec import TokenLogprob


def sampling(request: CanonicalRequest) -> tuple[Any, list[Any]]:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    s = request.sampling
    if not s.is_greedy and s.seed is not None:
        # Seeded on the one lane, batch of one: the sampled answer is reproducible.
        mx.random.seed(s.seed % 2**64)
    sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0,
                           min_p=s.min_p, top_k=s.top_k)
    processors = make_logits_processors(
        logit_bias=dict(request.logit_bias) or None,
        repetition_penalty=request.repetition_penalty if request.repetition_penalty != 1 else None,
        presence_penalty=request.presence_penalty or None,
        frequency_penalty=request.frequency_penalty or None,
    )
    return sampler, processors


def logprob(tokenizer: Any, token: int, logprobs: Any, top: int) -> TokenLogprob:
    import mlx.core as mx

    decode = tokenizer.decode
    alternatives: tuple[tuple[int, str, float], ...] = ()
    if top:
        ids = cast(list[int], mx.argsort(-logprobs)[:top].tolist())
        alternatives = tuple((i, decode([i]), float(logprobs[i].item())) for i in ids)
    return TokenLogprob(token, decode([token]), float(logprobs[token].item()), alternatives)
