"""The `compare` command's flags and its run: candidate runner, replay, outputs, gate."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cacheproxy.cli.settings import Settings

if TYPE_CHECKING:
    from cacheproxy.cli.compare import Comparison
    from cacheproxy.runners.base import Runner


def add_parser(sub: Any) -> None:
    """The `compare` subcommand."""
    cp = sub.add_parser("compare", help="replay stored entries on a candidate producer and "
                        "report what changed (exact, by meaning, against the margins)")
    cp.add_argument("--to", metavar="CANDIDATE",
                    help="a model directory (run in-process) or an mlx_lm.server URL "
                         "(with --cassette, default: --model, the runtime installed here)")
    cp.add_argument("--cassette", type=Path, metavar="FILE",
                    help="compare the entries of a recording (jsonl) instead of a store's")
    cp.add_argument("--rewrite", action="store_true",
                    help="with --cassette: rewrite it for the candidate, keeping the entries "
                         "whose meaning is unchanged; exit 1 when any changed")
    cp.add_argument("--to-model-dir", metavar="DIR",
                    help="with an upstream URL: the model directory it serves (default: "
                         "--model's)")
    cp.add_argument("--store")
    cp.add_argument("--model", help="the model the entries were stored for (default: the "
                    "demo model); its namespace is the default")
    cp.add_argument("--model-id", dest="model_id")
    cp.add_argument("--namespace", metavar="DIGEST")
    cp.add_argument("--sample", type=int, metavar="N", help="compare N random entries")
    cp.add_argument("--extract", metavar="REGEX|module:function",
                    help="compare plain-text answers by what this extracts from them")
    cp.add_argument("--json", action="store_true")
    cp.add_argument("--report", type=Path, metavar="FILE.html",
                    help="write an HTML report with a plot (needs cacheproxy[report])")
    cp.add_argument("--require-exact", type=_rate, metavar="R",
                    help="exit 1 when the exact-match rate is below R (0..1)")
    cp.add_argument("--require-parsed", type=_rate, metavar="R",
                    help="exit 1 when the parsed-match rate is below R (0..1)")
    cp.add_argument("--prefill-step", type=int, help="the runners' prefill step")
    cp.add_argument("--prefix-cache-bytes", type=int, help="exact prefix reuse (0: off)")
    cp.add_argument("--decode-slots", type=int, help="the runners' decode slots")


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a rate between 0 and 1")
    return rate


async def run(settings: Settings, args: argparse.Namespace) -> int:
    """Compare, print (table or JSON), write the report, apply the gates."""
    from cacheproxy.cli import compare as cmp
    from cacheproxy.cli.candidates import candidate_runner, started, stored_namespace
    from cacheproxy.cli.meaning import load_extractor

    extractor = load_extractor(args.extract) if args.extract else None
    settings = _with_cassette(settings, args)
    if args.report is not None:
        from cacheproxy.cli.compare_html import require_matplotlib

        require_matplotlib()
    if args.sample is not None and args.sample < 1:
        raise ValueError(f"--sample {args.sample}: give 1 or more entries")
    target = args.to or settings.model_for(settings.served_model_id)
    runner = candidate_runner(settings, target, args.to_model_dir)  # (checks --to first)
    namespace = args.namespace or (await cassette_namespace(settings.store) if args.cassette
                                   else stored_namespace(settings))
    # Whatever the runners log while they work goes to stderr: stdout holds the report only
    # (the upstream runner logs through structlog, whose default is stdout).
    with contextlib.redirect_stdout(sys.stderr):
        async with started(runner):
            comparison = await cmp.compare(runner, target, settings.store,
                                           namespace=namespace, sample=args.sample,
                                           extractor=extractor, progress=not args.json)
    if args.json:
        cmp.write_json(comparison)
    else:
        cmp.print_table(comparison)
    if args.report is not None:
        cmp.write_report(comparison, args.report)
        print(f"report written to {args.report}", file=sys.stderr)
    failed = cmp.gate(comparison, require_exact=args.require_exact,
                      require_parsed=args.require_parsed)
    if args.rewrite:
        failed += await _rewrite(args.cassette, comparison, runner, settings)
    for reason in failed:
        print(f"cacheproxy compare: {reason}", file=sys.stderr)
    return 1 if failed else 0


def _with_cassette(settings: Settings, args: argparse.Namespace) -> Settings:
    """The settings with the cassette as the store; the flags that go with it checked."""
    if args.cassette is None:
        if args.rewrite:
            raise ValueError("--rewrite rewrites a cassette: give --cassette FILE")
        if args.to is None:
            raise ValueError("say what to compare with: --to CANDIDATE (or --cassette FILE)")
        return settings
    if not args.cassette.is_file():
        raise ValueError(f"--cassette {args.cassette}: no such file")
    if args.store is not None:
        raise ValueError("--cassette and --store name two stores: give one")
    if args.rewrite and args.sample is not None:
        raise ValueError("--rewrite rewrites every entry: it does not take --sample")
    return dataclasses.replace(settings, store=f"jsonl://{args.cassette.resolve()}")


async def cassette_namespace(url: str) -> str:
    """The one namespace a cassette holds (--namespace picks one of several)."""
    from cacheproxy.service.cassette import open_store
    from cacheproxy.service.namespaces import Registry

    store = await open_store(url, replay=True)
    try:
        found = sorted(await Registry(store).load())
    finally:
        await store.aclose()
    if len(found) != 1:
        raise ValueError(f"the cassette holds {len(found)} namespaces"
                         f"{' (' + ', '.join(found) + ')' if found else ''}: pick one with "
                         "--namespace" if found else "the cassette holds no entries")
    return found[0]


async def _rewrite(path: Path, comparison: Comparison, runner: Runner,
                   settings: Settings) -> list[str]:
    """Rewrite the cassette; the entries whose meaning changed, as gate failures."""
    from cacheproxy.cli.rewrite import rewrite

    done = await rewrite(path, comparison, runner.fingerprint(),
                         record_key=settings.record_key.encode())
    print(f"rewrote {path}: {len(done.carried)} entries carried over to fingerprint "
          f"{runner.fingerprint().digest}, {len(done.changed)} left out", file=sys.stderr)
    return [f"meaning changed: {r.key} ({r.difference.reason if r.difference else 'differs'})"
            f"\n    stored    {r.stored_text!r}\n    candidate {r.candidate_text!r}"
            for r in done.changed]
