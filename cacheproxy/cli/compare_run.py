"""The `compare` command's flags and its run: candidate runner, replay, outputs, gate."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from cacheproxy.cli.settings import Settings


def add_parser(sub: Any) -> None:
    """The `compare` subcommand."""
    cp = sub.add_parser("compare", help="replay stored entries on a candidate producer and "
                        "report what changed (exact, by meaning, against the margins)")
    cp.add_argument("--to", required=True, metavar="CANDIDATE",
                    help="a model directory (run in-process) or an mlx_lm.server URL")
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
    if args.report is not None:
        from cacheproxy.cli.compare_html import require_matplotlib

        require_matplotlib()
    if args.sample is not None and args.sample < 1:
        raise ValueError(f"--sample {args.sample}: give 1 or more entries")
    runner = candidate_runner(settings, args.to, args.to_model_dir)  # (checks --to first)
    namespace = args.namespace or stored_namespace(settings)
    # Whatever the runners log while they work goes to stderr: stdout holds the report only
    # (the upstream runner logs through structlog, whose default is stdout).
    with contextlib.redirect_stdout(sys.stderr):
        async with started(runner):
            comparison = await cmp.compare(runner, args.to, settings.store,
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
    for reason in failed:
        print(f"cacheproxy compare: {reason}", file=sys.stderr)
    return 1 if failed else 0
