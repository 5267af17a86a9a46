"""`cacheproxy` command line: serve, demo-model, fingerprint, stats, inspect, purge, verify."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from cacheproxy import __version__
from cacheproxy.cli.settings import Settings, build_settings
from cacheproxy.errors import UpstreamUnavailable


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheproxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cacheproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI API with the cache in front")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--model", help="model directory or Hugging Face repo (default: demo)")
    serve.add_argument("--model-id", dest="model_id", help="the name clients use")
    serve.add_argument("--store", help="memory://, disk:///path (default: user cache dir)")
    serve.add_argument("--sampling", choices=["force-greedy", "seeded", "bypass"])
    serve.add_argument("--queue-size", dest="queue_size", type=int)
    serve.add_argument("--generation-timeout", dest="generation_timeout", type=float)
    serve.add_argument("--max-body-bytes", dest="max_body_bytes", type=int)
    serve.add_argument("--default-max-tokens", dest="default_max_tokens", type=int)
    serve.add_argument("--max-tokens-cap", dest="max_tokens_cap", type=int)
    serve.add_argument("--device-scope", dest="device_scope", action="store_const", const=True)
    serve.add_argument("--no-watch", dest="watch", action="store_const", const=False,
                       help="do not watch the model files for changes")
    serve.add_argument("--watch-interval", dest="watch_interval", type=float)
    serve.add_argument("--reload-wait", dest="reload_wait", type=float)
    serve.add_argument("--invalidation", choices=["purge", "retain"])
    serve.add_argument("--digest-memo", dest="digest_memo")
    serve.add_argument("--ttl", type=float, help="seconds an entry lives (default: no expiry)")
    serve.add_argument("--api-key", dest="api_keys", action="append",
                       help="accepted client API key (repeatable; env CACHEPROXY_API_KEYS)")
    serve.add_argument("--cache-scope", dest="cache_scope", choices=["shared", "per-key"])
    serve.add_argument("--max-in-flight", dest="max_in_flight", type=int,
                       help="requests served at once before 503")
    serve.add_argument("--max-connections", dest="max_connections", type=int,
                       help="open client connections before new ones get 503")
    serve.add_argument("--store-retry", dest="store_retry", type=float,
                       help="seconds to answer without the store after a failure")
    serve.add_argument("--lock-ttl", dest="lock_ttl", type=float,
                       help="seconds a cross-replica fill lease lives unless renewed")
    serve.add_argument("--upstream", action="append", metavar="URL",
                       help="generate on a running mlx_lm.server instead of in-process "
                            "(repeatable: a pool; env CACHEPROXY_UPSTREAM, comma-separated)")
    serve.add_argument("--model-dir", dest="model_dir", metavar="PATH",
                       help="with --upstream: the model directory the upstream serves")
    serve.add_argument("--upstream-timeout", dest="upstream_timeout", type=float,
                       help="seconds to connect to an upstream, and its longest silence")
    serve.add_argument("--log-format", dest="log_format", choices=["auto", "json", "console"])
    serve.add_argument("--log-level", dest="log_level")

    demo = sub.add_parser("demo-model", help="write a copy of the bundled demo model")
    demo.add_argument("--out", required=True, type=Path)
    demo.add_argument("--quantize", type=int, choices=[4, 8])
    demo.add_argument("--retrain", action="store_true", help="train from the recipe instead")
    demo.add_argument("--steps", type=int, help="training steps with --retrain")

    fpr = sub.add_parser("fingerprint", help="print the pinned configuration tuple as JSON")
    fpr.add_argument("--model", help="model directory (default: the demo model)")

    st = sub.add_parser("stats", help="entries and bytes per namespace")
    st.add_argument("--store")
    st.add_argument("--json", action="store_true")

    ins = sub.add_parser("inspect", help="one entry with its provenance")
    ins.add_argument("key")
    ins.add_argument("--store")
    ins.add_argument("--json", action="store_true")

    pg = sub.add_parser("purge", help="remove entries")
    pg.add_argument("--store")
    what = pg.add_mutually_exclusive_group(required=True)
    what.add_argument("--superseded", action="store_true", help="every superseded namespace")
    what.add_argument("--namespace", metavar="DIGEST")
    what.add_argument("--key")
    what.add_argument("--all", action="store_true", help="everything (asks unless --yes)")
    pg.add_argument("--yes", action="store_true")

    vf = sub.add_parser("verify", help="replay stored entries and compare byte for byte")
    vf.add_argument("--store")
    vf.add_argument("--model", help="model directory or repo (default: the demo model)")
    vf.add_argument("--model-id", dest="model_id")
    vf.add_argument("--namespace", metavar="DIGEST", help="default: the runner's fingerprint")
    vf.add_argument("--sample", type=int, metavar="N", help="check N random entries")
    vf.add_argument("--cross-fingerprint", action="store_true",
                    help="compare entries of another fingerprint (an upgrade audit)")
    vf.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and of `python -m cacheproxy`."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            flags = {k: v for k, v in vars(args).items() if k != "command"}
            from cacheproxy.cli.serve import serve

            return serve(build_settings(flags, os.environ))
        if args.command == "demo-model":
            return demo_model(args.out, args.quantize, args.retrain, args.steps)
        if args.command == "fingerprint":
            return fingerprint(args.model)
        return asyncio.run(_store_command(args))
    except (ValueError, FileNotFoundError, FileExistsError, UpstreamUnavailable) as exc:
        print(f"cacheproxy: error: {exc}", file=sys.stderr)
        return 2


async def _store_command(args: argparse.Namespace) -> int:
    from cacheproxy.cli import store as store_cli

    flags = {"store": args.store, "model": getattr(args, "model", None),
             "model_id": getattr(args, "model_id", None)}
    settings = build_settings(flags, os.environ)
    if args.command == "stats":
        return await store_cli.stats(settings.store, as_json=args.json)
    if args.command == "inspect":
        return await store_cli.inspect(settings.store, args.key, as_json=args.json)
    if args.command == "purge":
        return await store_cli.purge(
            settings.store, superseded=args.superseded, namespace=args.namespace, key=args.key,
            everything=args.all, confirm=lambda what: args.yes or _ask(what))
    return await _verify(settings, args)


def _ask(what: str) -> bool:
    if not sys.stdin.isatty():
        print(f"refusing to {what} without --yes (no terminal to ask)", file=sys.stderr)
        return False
    return input(f"{what}? type 'yes' to confirm: ").strip() == "yes"


async def _verify(settings: Settings, args: argparse.Namespace) -> int:
    from cacheproxy.cli.verify import print_report, verify
    from cacheproxy.runners.mlx import MlxOptions, MlxRunner

    runner = MlxRunner(MlxOptions(model=settings.model, model_id=settings.served_model_id,
                                  digest_memo=Path(settings.digest_memo)))
    await runner.start()
    try:
        report = await verify(runner, settings.store, namespace=args.namespace,
                              sample=args.sample, cross_fingerprint=args.cross_fingerprint,
                              progress=not args.json)
    finally:
        await runner.aclose()
    print_report(report, as_json=args.json)
    return 0 if not report.mismatches else 1


def demo_model(out: Path, quantize: int | None, retrain: bool, steps: int | None) -> int:
    """Write the demo model: a copy, a quantized copy, or a retrained one."""
    from dataclasses import replace

    from cacheproxy.runners.demo import model as dm

    if retrain:
        if quantize is not None:
            raise ValueError("--retrain and --quantize are separate steps")
        recipe = dm.Recipe() if steps is None else replace(dm.Recipe(), steps=steps)
        dm.train(out, recipe)
    else:
        if steps is not None:
            raise ValueError("--steps needs --retrain")
        dm.write_copy(out, quantize=quantize)
    print(out)
    return 0


def fingerprint(model: str | None) -> int:
    """Print the pinned configuration tuple and its digest."""
    from cacheproxy.cli.settings import DEMO_MODEL_ID
    from cacheproxy.keys import fingerprint as fp
    from cacheproxy.runners.demo.model import BUNDLED_MODEL

    path = Path(model) if model else BUNDLED_MODEL
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    result = fp.compute(model or DEMO_MODEL_ID, path)
    print(json.dumps({"digest": result.digest, "fields": result.fields()}, indent=2))
    return 0
