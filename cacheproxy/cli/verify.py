"""`cacheproxy verify`: replay stored entries through the current runner, compare byte for byte.

The replay goes through the same lane and the same determinism rewrite as a miss (the
stored canonical request already is the rewritten one), so on the machine and runtime
that produced an entry the exact-match rate is 100 %. Across fingerprints
(`--cross-fingerprint`) it shows how an upgrade changed the answers.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import TextIO

from cacheproxy.cli.replay import replay
from cacheproxy.runners.base import Runner


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One entry whose replay differs, and where."""

    key: str
    first_diverging_token: int | None
    reason: str
    stored_text: str = ""
    replayed_text: str = ""
    margin: float | None = None  # the stored answer's smallest near-tie gap (if recorded)


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


async def verify(
    runner: Runner, url: str, *, namespace: str | None, sample: int | None,
    cross_fingerprint: bool, progress: bool = True,
) -> Report:
    """Replay entries of one namespace (default: the runner's) and compare (`replay`'s
    engine: verify is `compare` against the runner that serves now, logprobs included)."""
    current = runner.fingerprint().digest
    target = namespace or current
    if target != current and not cross_fingerprint:
        raise ValueError(
            f"namespace {target} was produced under another fingerprint than the runner's "
            f"({current}); pass --cross-fingerprint to compare across them")
    replayed = await replay(runner, url, namespace=target, sample=sample, logprobs=True,
                            progress=progress, desc="verify")
    report = Report(current, target, runner.defaults().model_id)
    for result in replayed.results:
        report.checked += 1
        if result.difference is None:
            report.matched += 1
            continue
        report.mismatches.append(Mismatch(
            result.key, result.first_divergence, result.difference.reason,
            result.stored_text, result.candidate_text,
            None if result.margin is None else result.margin.smallest))
    return report


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
        margin = "" if m.margin is None else f" (stored margin {m.margin:.4g})"
        print(f"  MISMATCH {m.key}: {m.reason}{where}{margin}", file=out)
        if m.stored_text or m.replayed_text:
            print(f"    stored   {m.stored_text!r}\n    replayed {m.replayed_text!r}", file=out)
