"""`cacheproxy compare --to CANDIDATE`: what a change of producer changes in the stored answers.

Replays the entries of a namespace (default: the one `--model` fills) on a candidate producer
— a model directory (another quantization, a fine-tune), run in-process, or the URL of a
running mlx_lm.server (another mlx version in another environment) — the reproducible way,
without writing to the store (`replay`, the engine `verify` uses too). Per entry: exact
(token ids, text, reasoning, tool calls, finish reason), the first diverging token, equal by
meaning (`meaning`), and the stored answer's near-tie margin; over all: both rates, what
differs between the two fingerprints, and where answers diverged against their margins.
`--require-exact R` / `--require-parsed R` make the exit status 1 below a rate (a CI gate).
`--cassette FILE` compares a recording, and `--rewrite` moves it to the candidate (`rewrite`).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from cacheproxy.cli.meaning import Extractor
from cacheproxy.cli.replay import EntryResult, Replayed, replay
from cacheproxy.keys.fingerprint import UNDIGESTED
from cacheproxy.keys.margin import LOWEST
from cacheproxy.runners.base import Runner

TEXT_WIDTH = 60  # characters of each text in the terminal table


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the entries are replayed on, as the user named it."""

    target: str  # a model directory or an upstream URL
    fingerprint: str
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Comparison:
    """The outcome of a compare run (JSON: `as_dict`)."""

    namespace: str
    candidate: Candidate
    stored_fields: Mapping[str, Any]
    results: tuple[EntryResult, ...]

    @property
    def checked(self) -> int:
        """Entries replayed."""
        return len(self.results)

    @property
    def exact_match_rate(self) -> float:
        """Fraction of entries whose replay is identical (1.0 when none was checked)."""
        return sum(r.exact for r in self.results) / self.checked if self.checked else 1.0

    @property
    def parsed_match_rate(self) -> float:
        """Fraction of entries whose replay means the same (see `meaning`)."""
        return sum(r.parsed_equal for r in self.results) / self.checked if self.checked \
            else 1.0

    def fingerprint_differences(self) -> dict[str, dict[str, Any]]:
        """The fields of the two fingerprints that differ (where the files are, and what they
        are called, are left out: they do not produce answers)."""
        names = [n for n in {**self.stored_fields, **self.candidate.fields} if n not in UNDIGESTED]
        return {n: {"stored": self.stored_fields.get(n), "candidate": self.candidate.fields.get(n)}
                for n in names if self.stored_fields.get(n) != self.candidate.fields.get(n)}

    def checks(self) -> list[str]:
        """What the comparison could check (an upstream's answers carry no token ids)."""
        made = ["text", "reasoning", "tool calls", "finish reason", "parsed answer"]
        if any(r.token_ids for r in self.results):
            made.insert(0, "token ids")
        if any(r.margin is not None for r in self.results):
            made.append("stored margins")
        return made

    def unchecked(self) -> list[str]:
        """What it could not check, and why."""
        missing = []
        if self.results and not all(r.token_ids for r in self.results):
            missing.append("token ids (an answer without them: an upstream's, or an entry "
                           "stored through mlx_lm.server), so no first diverging token")
        if self.results and not all(r.margin is not None for r in self.results):
            missing.append("margins of entries that have none (stored before #33, or by an "
                           "upstream)")
        return missing

    def divergences(self) -> dict[str, Any]:
        """Where answers diverged against the stored margins."""
        diverged = [r for r in self.results if not r.exact]
        exact = [r for r in self.results if r.exact]

        def median(rs: list[EntryResult]) -> float | None:
            values = [r.margin.smallest for r in rs if r.margin and r.margin.smallest is not None]
            return statistics.median(values) if values else None

        rows = [_divergence(r) for r in diverged]
        return {
            "count": len(diverged),
            "at_smallest_margin": sum(1 for r in diverged if r.margin is not None
                                      and r.first_divergence is not None
                                      and r.first_divergence == r.margin.at),
            "at_a_kept_near_tie": sum(1 for d in rows if d["gap_at_divergence"] is not None),
            "median_margin_diverged": median(diverged),
            "median_margin_exact": median(exact),
            "entries": rows,
        }

    def as_dict(self) -> dict[str, Any]:
        """The whole report as JSON-able data."""
        return {
            "namespace": self.namespace, "candidate": self.candidate.target,
            "checked": self.checked, "exact_match_rate": self.exact_match_rate,
            "parsed_match_rate": self.parsed_match_rate,
            "fingerprints": {"stored": {"digest": self.namespace,
                                        "fields": dict(self.stored_fields)},
                             "candidate": {"digest": self.candidate.fingerprint,
                                           "fields": dict(self.candidate.fields)},
                             "differ": self.fingerprint_differences()},
            "checks": self.checks(), "unchecked": self.unchecked(),
            "divergences": self.divergences(),
            "entries": [entry(r) for r in self.results],
        }


def _divergence(r: EntryResult) -> dict[str, Any]:
    """A diverged entry: where, and the stored gap there (exactly when it is among the
    smallest the entry kept, else at least the largest of those)."""
    at, m = r.first_divergence, r.margin
    exactly, at_least = m.gap_at(at) if m is not None and at is not None else (None, None)
    return {"key": r.key, "first_divergence": at,
            "reason": r.difference.reason if r.difference else None,
            "margin": m.smallest if m else None, "margin_at": m.at if m else None,
            "gap_at_divergence": exactly, "gap_at_divergence_at_least": at_least,
            "parsed_equal": r.parsed_equal}


def entry(r: EntryResult) -> dict[str, Any]:
    """One entry's row of the report."""
    return {"key": r.key, "exact": r.exact, "first_divergence": r.first_divergence,
            "difference": r.difference.reason if r.difference else None,
            "parsed_equal": r.parsed_equal, "compared_by": r.compared_by,
            "margin": asdict(r.margin) if r.margin else None,
            "stored_text": r.stored_text, "candidate_text": r.candidate_text}


async def compare(candidate: Runner, target: str, url: str, *, namespace: str,
                  sample: int | None, extractor: Extractor | None,
                  progress: bool = True) -> Comparison:
    """Replay `namespace` on a started candidate runner and compare."""
    replayed: Replayed = await replay(candidate, url, namespace=namespace, sample=sample,
                                      logprobs=False, extractor=extractor, progress=progress,
                                      desc="compare")
    fp = candidate.fingerprint()
    return Comparison(namespace, Candidate(target, fp.digest, fp.fields()),
                      replayed.stored_fields, replayed.results)


def gate(comparison: Comparison, *, require_exact: float | None,
         require_parsed: float | None) -> list[str]:
    """The gates the comparison fails (empty: the exit status is 0). Nothing compared fails
    too: a gate must not pass on a namespace that holds no entries (a wrong --model)."""
    if not comparison.checked:
        return [f"no entries compared: namespace {comparison.namespace} holds none"]
    failed = []
    if require_exact is not None and comparison.exact_match_rate < require_exact:
        failed.append(f"exact-match rate {comparison.exact_match_rate:.1%} is below the "
                      f"required {require_exact:.1%}")
    if require_parsed is not None and comparison.parsed_match_rate < require_parsed:
        failed.append(f"parsed-match rate {comparison.parsed_match_rate:.1%} is below the "
                      f"required {require_parsed:.1%}")
    return failed


def _short(text: str) -> str:
    text = repr(text)
    return text if len(text) <= TEXT_WIDTH else text[:TEXT_WIDTH - 3] + "..."


def print_table(c: Comparison, out: TextIO | None = None) -> None:
    """A readable summary and one line per entry."""
    out = out or sys.stdout  # (looked up per call: a default would be the import's)
    print(f"compared {c.checked} entries of namespace {c.namespace} with {c.candidate.target} "
          f"({c.candidate.fingerprint})", file=out)
    print(f"exact-match rate  {c.exact_match_rate:.1%}\nparsed-match rate "
          f"{c.parsed_match_rate:.1%}", file=out)
    for name, pair in c.fingerprint_differences().items():
        print(f"  differs: {name}: {pair['stored']} -> {pair['candidate']}", file=out)
    print(f"checked: {', '.join(c.checks())}", file=out)
    for missing in c.unchecked():
        print(f"not checked: {missing}", file=out)
    print(f"{'key':14} {'exact':5} {'diverges':>8} {'parsed':6} {'margin':>9} {'at':>4}  "
          "stored / candidate", file=out)
    for r in c.results:
        m = r.margin
        margin = "-" if m is None or m.smallest is None else f"{m.smallest:.3g}"
        at = "-" if m is None or m.at is None else str(m.at)
        where = "-" if r.first_divergence is None else str(r.first_divergence)
        print(f"{r.key.partition('/')[2][:12]:14} {'yes' if r.exact else 'no':5} {where:>8} "
              f"{'yes' if r.parsed_equal else 'no':6} {margin:>9} {at:>4}  "
              f"{_short(r.stored_text)}", file=out)
        if not r.exact:
            print(f"{'':56}{_short(r.candidate_text)}", file=out)
    d = c.divergences()
    if d["count"]:
        print(f"{d['count']} diverged: {d['at_smallest_margin']} at the stored answer's smallest "
              f"margin, {d['at_a_kept_near_tie']} at one of its {LOWEST} smallest; median "
              f"margin diverged {_g(d['median_margin_diverged'])}, exact "
              f"{_g(d['median_margin_exact'])}", file=out)
        for row in d["entries"]:
            print(f"  {row['key']}: {row['reason']}{_where(row)}", file=out)


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _where(row: dict[str, Any]) -> str:
    if row["first_divergence"] is None:
        return ""
    gap = f"stored gap {row['gap_at_divergence']:.3g}" if row["gap_at_divergence"] is not None \
        else f"stored gap >= {row['gap_at_divergence_at_least']:.3g}" \
        if row["gap_at_divergence_at_least"] is not None else "stored gap not known"
    return f" at token {row['first_divergence']} ({gap}; smallest {_g(row['margin'])} at " \
        f"{row['margin_at']})"


def write_json(c: Comparison, out: TextIO | None = None) -> None:
    """The whole report as JSON."""
    print(json.dumps(c.as_dict(), indent=2, ensure_ascii=False), file=out or sys.stdout)


def write_report(c: Comparison, path: Path) -> None:
    """The HTML report with its plot (needs matplotlib: `pip install 'cacheproxy[report]'`)."""
    from cacheproxy.cli.compare_html import render

    path.write_text(render(c.as_dict()), encoding="utf-8")
