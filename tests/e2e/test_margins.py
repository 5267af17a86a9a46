"""Near-tie margins (#33): the margin an entry records is the gap of the model's real logits,
for the one-slot runner and the pinned batch; `inspect` and `stats` show it.

The reference is computed apart from the runner: mlx_lm.load of the demo model, one forward
pass over the prompt and the answer, top-1 minus top-2 at every decision. A near tie is then
constructed with a logit bias that brings a runner-up to 0.002 below the chosen token: the
recorded margin follows, and (the control) a bias 0.002 beyond the gap flips the token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.keys.margin import NEAR_TIE, from_provenance
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import MlxRunner
from tests.conftest import Proxy, ProxyFactory
from tests.harness.cli import cacheproxy_blocking

PROMPT = "The fox"
MAX_TOKENS = 24
TOLERANCE = 1e-4  # a full forward pass against the runner's cached decode: rounding only


@pytest.fixture(scope="module")
def reference() -> Any:
    """The demo model and tokenizer, loaded by mlx_lm apart from the runner under test."""
    from mlx_lm import load

    return load(str(BUNDLED_MODEL))


def real_gaps(reference: Any, token_ids: list[int], *, eos: bool,
              bias: dict[int, float] | None = None) -> list[tuple[int, int, float]]:
    """(chosen, runner-up, gap) of every decision of an answer, from one forward pass."""
    import mlx.core as mx

    model, tokenizer = reference
    prompt = list(tokenizer.encode(PROMPT, add_special_tokens=True))
    decided = token_ids + ([tokenizer.eos_token_id] if eos else [])
    logits = model(mx.array(prompt + token_ids)[None])[0, len(prompt) - 1:]
    for token, value in (bias or {}).items():
        logits[:, token] += value
    gaps = []
    for row, chosen in zip(logits.tolist(), decided, strict=False):
        runner_up = max((v, i) for i, v in enumerate(row) if i != chosen)
        gaps.append((chosen, runner_up[1], row[chosen] - runner_up[0]))
    return gaps


async def complete(proxy: Proxy, **extra: Any) -> tuple[str, dict[str, Any]]:
    """One completion through the proxy: its key and the stored record's view."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, **extra}
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["X-Cache"] == "MISS", await resp.text()
        key = resp.headers["X-Cache-Key"]
    from cacheproxy.keys import codec

    data = await proxy.store.get(key)
    assert data is not None
    return key, codec.record_view(key, codec.decode(data))


def check_against(view: dict[str, Any], gaps: list[tuple[int, int, float]]) -> None:
    margin = from_provenance(view["provenance"])
    assert margin is not None and margin.tokens == len(gaps)
    values = [g for _, _, g in gaps]
    assert margin.at == values.index(min(values))
    assert margin.smallest == pytest.approx(min(values), abs=TOLERANCE)
    assert margin.near_ties == sum(g < NEAR_TIE for g in values)
    for at, value in margin.lowest:
        assert value == pytest.approx(values[at], abs=TOLERANCE), at


def near_tie_bias(gaps: list[tuple[int, int, float]], beyond: float) -> tuple[int, int, float]:
    """(position, runner-up, bias) that brings the runner-up of the latest decision whose
    earlier decisions all keep a lead larger than the bias to `beyond` from its chosen one."""
    for k in range(len(gaps) - 1, 0, -1):
        _, runner_up, gap = gaps[k]
        bias = gap + beyond
        if bias > 0 and all(c != runner_up and g > bias + 0.1 for c, _, g in gaps[:k]):
            return k, runner_up, bias
    raise AssertionError("no decision to bring to a near tie")


@pytest.mark.parametrize("slots", [1, 2])
async def test_the_recorded_margin_is_the_gap_of_the_real_logits_and_follows_a_near_tie(
    make_proxy: ProxyFactory, runner: MlxRunner, reference: Any, tmp_path: Path, slots: int
) -> None:
    store = f"disk://{tmp_path}/store"
    proxy = await make_proxy(store=store, own_runners=slots > 1, decode_slots=slots)
    _, view = await complete(proxy)
    ids = view["output"]["token_ids"]
    gaps = real_gaps(reference, ids, eos=view["output"]["finish_reason"] == "stop")
    assert [c for c, _, _ in gaps[:len(ids)]] == ids  # greedy: each chosen token is the top
    check_against(view, gaps)

    # A near tie, constructed: a bias brings a runner-up to 0.002 below the chosen token.
    k, runner_up, bias = near_tie_bias(gaps, -0.002)
    _, tied = await complete(proxy, logit_bias={str(runner_up): bias})
    margin = from_provenance(tied["provenance"])
    assert margin is not None and margin.at == k and margin.near_ties >= 1
    assert margin.smallest == pytest.approx(0.002, abs=TOLERANCE)
    assert tied["output"]["token_ids"][:k + 1] == ids[:k + 1]
    # The control: 0.002 beyond the gap, the runner-up wins that decision.
    _, flipped = await complete(proxy, logit_bias={str(runner_up): bias + 0.004})
    assert flipped["output"]["token_ids"][k] == runner_up

    # inspect (readable and JSON) and stats show it.
    shown = cacheproxy_blocking("inspect", tied["key"], "--store", store)
    assert shown.returncode == 0 and f"at token {k};" in shown.stdout, shown.stdout
    as_json = json.loads(cacheproxy_blocking("inspect", tied["key"], "--store", store,
                                             "--json").stdout)
    assert as_json["provenance"]["margin"]["at"] == k
    stats = json.loads(cacheproxy_blocking("stats", "--store", store, "--json").stdout)
    (namespace,) = stats["namespaces"]
    smallest = min(g for _, _, g in gaps)  # the plain answer's; the two biased ones: ~0.002
    assert namespace["fragile"] == {"below": NEAR_TIE, "read": 3, "with_margin": 3,
                                    "fragile": 2 + (smallest < NEAR_TIE)}
    # A threshold above every margin makes all three fragile: the count follows the flag.
    above = max(smallest, NEAR_TIE) * 2
    loose = json.loads(cacheproxy_blocking("stats", "--store", store, "--json",
                                           "--fragile-below", str(above)).stdout)
    assert loose["namespaces"][0]["fragile"]["fragile"] == 3
