"""`cacheproxy verify`: replay stored entries through the current runner, compare byte for byte.

The replay goes through the same lane and the same determinism rewrite as a miss (the
stored canonical request already is the rewritten one), so on the machine and runtime
that produced an entry the exact-match rate is 100 %. Across fingerprints
(`--cross-fingerprint`) it shows how an upgrade changed the answers.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import asdict, dataclass, field
from typing import TextIO

from backends import listing
from backends.base import Backend
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.runners.base import Runner
from cacheproxy.service.cassette import open_store


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One entry whose replay differs, and where."""

    key: str
    first_diverging_token: int | None
    reason: str
    stored_text: str = ""
    replayed_text: str = ""


@dataclass(slots=True)
class Report:
    """The outcome of a verify run."""

    runner_fingerprint: str
    namespace: str
    model: str = ""  # the model id the runner serves
    checked: int = 0
    matched: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def exact_match_rate(self) -> float:
        """Fraction of checked entries whose replay is identical."""
        return self.matched / self.checked if self.checked else 1.0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(key: str, stored: codec.Output, replayed: codec.Output) -> Mismatch | None:
    """Tokens, text, reasoning, tool calls, finish reason and (when stored) logprobs must
    all be identical."""
    # Entries generated through mlx_lm.server carry no token ids: compare their text.
    with_ids = bool(stored.token_ids) and bool(replayed.token_ids)
    position = first_divergence(stored.token_ids, replayed.token_ids) if with_ids else None
    if position is not None:
        return Mismatch(key, position, "tokens differ", stored.text, replayed.text)
    if stored.text != replayed.text:
        return Mismatch(key, None, "text differs", stored.text, replayed.text)
    if stored.reasoning != replayed.reasoning:
        return Mismatch(key, None, "reasoning differs", stored.reasoning, replayed.reasoning)
    if stored.tool_calls != replayed.tool_calls:
        return Mismatch(key, None, "tool calls differ", repr(stored.tool_calls),
                        repr(replayed.tool_calls))
    if stored.finish_reason != replayed.finish_reason:
        return Mismatch(key, None, "finish reason differs")
    lp_a = [lp.logprob for c in stored.chunks for lp in c.logprobs]
    lp_b = [lp.logprob for c in replayed.chunks for lp in c.logprobs]
    if lp_a and lp_a != lp_b:
        where = next(i for i, (x, y) in enumerate(zip(lp_a, lp_b, strict=False)) if x != y)
        return Mismatch(key, where, "logprobs differ")
    return None


async def verify(
    runner: Runner, url: str, *, namespace: str | None, sample: int | None,
    cross_fingerprint: bool, progress: bool = True,
) -> Report:
    """Replay entries of one namespace (default: the runner's) and compare."""
    current = runner.fingerprint().digest
    target = namespace or current
    if target != current and not cross_fingerprint:
        raise ValueError(
            f"namespace {target} was produced under another fingerprint than the runner's "
            f"({current}); pass --cross-fingerprint to compare across them")
    store = await open_store(url, replay=True)  # read only
    report = Report(current, target, runner.defaults().model_id)
    try:
        # A sample lists only the pages it takes its keys from (at 1M entries, listing
        # them all costs ~1000 pages).
        keys = await listing.keys(store, target + "/") if sample is None else \
            await listing.sample(store, target + "/", sample, random.Random())
        from tqdm import tqdm

        for key in tqdm(keys, desc="verify", unit="entry", disable=not progress):
            await _check(runner, store, key, report)
    finally:
        await store.aclose()
    return report


async def _check(runner: Runner, store: Backend, key: str, report: Report) -> None:
    data = await store.get(key)
    if data is None:
        return  # purged or expired meanwhile
    report.checked += 1
    try:
        record = codec.decode(data)
    except codec.CorruptRecord as exc:
        report.mismatches.append(Mismatch(key, None, f"undecodable: {exc}"))
        return
    generation = runner.generate(CanonicalRequest.from_wire(record.request))
    async for _ in generation.chunks():
        pass
    if generation.output is None:
        raise RuntimeError("replay ended without output")
    mismatch = compare(key, record.output, generation.output)
    if mismatch is None:
        report.matched += 1
    else:
        report.mismatches.append(mismatch)


def print_report(report: Report, *, as_json: bool, out: TextIO | None = None) -> None:
    """A one-screen summary, or the whole report as JSON."""
    out = out or sys.stdout  # (looked up per call: a default would be the import's)
    if as_json:
        data = {**asdict(report), "exact_match_rate": report.exact_match_rate}
        print(json.dumps(data, indent=2, ensure_ascii=False), file=out)
        return
    print(f"verified {report.checked} entries of namespace {report.namespace} against model "
          f"{report.model} (runner {report.runner_fingerprint}): exact-match rate "
          f"{report.exact_match_rate:.1%} ({report.matched}/{report.checked})", file=out)
    for m in report.mismatches:
        where = "" if m.first_diverging_token is None else \
            f" at token {m.first_diverging_token}"
        print(f"  MISMATCH {m.key}: {m.reason}{where}", file=out)
        if m.stored_text or m.replayed_text:
            print(f"    stored   {m.stored_text!r}\n    replayed {m.replayed_text!r}", file=out)
