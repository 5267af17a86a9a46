"""`cacheproxy` command line: serve, demo-model, agent-model, fingerprint, stats, inspect,
purge, export, import, verify, compare, explain."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, get_args

from backends.base import BackendError
from cacheproxy import __version__
from cacheproxy.cli import compare_run
from cacheproxy.cli.settings import Settings, build_settings
from cacheproxy.errors import UpstreamUnavailable
from cacheproxy.keys.canonical import Route

# `serve` flags: (flag, argparse options); each is also CACHEPROXY_<DEST> (cli/settings.py).
SERVE_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--host", {}),
    ("--port", {"type": int}),
    ("--model", {"action": "append", "metavar": "[ID=]PATH",
                 "help": "model directory or Hugging Face repo (default: demo); repeat as "
                         "ID=PATH to serve several"}),
    ("--model-id", {"help": "the name clients use"}),
    ("--store", {"help": "memory://, disk:///path (default: user cache dir)"}),
    ("--sampling", {"choices": ["force-greedy", "seeded", "bypass"]}),
    ("--queue-size", {"type": int}),
    ("--generation-timeout", {"type": float}),
    ("--max-body-bytes", {"type": int}),
    ("--default-max-tokens", {"type": int}),
    ("--max-tokens-cap", {"type": int}),
    ("--max-answer-tokens", {"type": int, "help": "n x max_tokens x (1 + top_logprobs) "
                             "an answer may hold (400 above)"}),
    ("--max-schema-bytes", {"type": int, "help": "bytes of one request's schemas (tools, "
                            "response_format) as JSON (400 schema_too_complex above)"}),
    ("--max-schema-properties", {"type": int,
                                 "help": "object properties in one request's schemas"}),
    ("--max-enum-values", {"type": int, "help": "enum and const values in one request's schemas"}),
    ("--max-tools", {"type": int, "help": "tools (or functions) one request may offer"}),
    ("--max-schema-depth", {"type": int, "help": "JSON nesting of one request's schemas"}),
    ("--schema-timeout", {"type": float,
                          "help": "CPU seconds one request's schema checks may use (off the "
                                  "loop)"}),
    ("--prefill-step", {"type": int,
                        "help": "prompt tokens per prefill chunk (in the fingerprint)"}),
    ("--prefix-cache-bytes", {"type": int,
                              "help": "bytes of KV state kept for exact prefix reuse (0: off)"}),
    ("--decode-slots", {"type": int, "metavar": "S",
                        "help": "generations decoded together, in a batch pinned at S rows "
                                "(1: one at a time; in the fingerprint)"}),
    ("--no-prefill-process", {"dest": "prefill_process", "action": "store_const",
                              "const": False,
                              "help": "with --decode-slots S > 1: prefill on a thread beside "
                                      "the decode steps, not in a process of its own (no "
                                      "second copy of the weights; slower decode under load)"}),
    ("--device-scope", {"action": "store_const", "const": True}),
    ("--no-watch", {"dest": "watch", "action": "store_const", "const": False,
                    "help": "do not watch the model files for changes"}),
    ("--watch-interval", {"type": float}),
    ("--reload-wait", {"type": float}),
    ("--invalidation", {"choices": ["purge", "retain"]}),
    ("--digest-memo", {}),
    ("--ttl", {"type": float, "help": "seconds an entry lives (default: no expiry)"}),
    ("--api-key", {"dest": "api_keys", "action": "append",
                   "help": "accepted client API key (repeatable; env CACHEPROXY_API_KEYS)"}),
    ("--allowed-hosts", {"action": "append", "metavar": "NAME[,NAME]",
                         "help": "bound to loopback without keys: Host names accepted besides "
                                 "loopback ones, '*' any (DNS rebinding guard)"}),
    ("--allowed-origins", {"action": "append", "metavar": "ORIGIN[,ORIGIN]",
                           "help": "bound to loopback without keys: browser origins allowed "
                                   "(scheme://host[:port]; '*' any); others get 403"}),
    ("--cache-scope", {"choices": ["shared", "per-key"]}),
    ("--shared-prefixes", {"action": "store_const", "const": True,
                           "help": "under --cache-scope per-key: every key reuses every key's "
                                   "saved prefix states (their reuse shows what others sent)"}),
    ("--status-access", {"choices": ["auto", "admin", "api-key", "public"],
                         "help": "who may read /metrics and /status.json"}),
    ("--max-in-flight", {"type": int, "help": "requests served at once before 503"}),
    ("--max-connections", {"type": int,
                           "help": "open client connections before new ones get 503"}),
    ("--max-connections-per-peer", {"type": int,
                                    "help": "of them, from one client address (loopback "
                                            "too); past it its own oldest give way, or 503"}),
    ("--idle-timeout", {"type": float, "help": "seconds a connection may take to send a "
                        "request's headers, after it opens or after its last response"}),
    ("--body-timeout", {"type": float, "help": "seconds a request body may take (408)"}),
    ("--body-min-rate", {"type": float, "metavar": "BYTES_PER_S",
                         "help": "rate a request body must keep up after 1 s (408; 0: none)"}),
    ("--max-body-connections", {"type": int,
                                "help": "connections in the middle of a request body; past "
                                        "it the oldest is cut (408)"}),
    ("--send-timeout", {"type": float,
                        "help": "seconds a client may leave an answer unread before it is cut"}),
    ("--send-buffer", {"type": int, "metavar": "BYTES",
                       "help": "kernel send buffer per client connection (0: the kernel's)"}),
    ("--store-retry", {"type": float,
                       "help": "seconds to answer without the store after a failure"}),
    ("--lock-ttl", {"type": float,
                    "help": "seconds a cross-replica fill lease lives unless renewed"}),
    ("--lease-ttl", {"type": float,
                     "help": "seconds a replica's lease on its namespace lives unless renewed"}),
    ("--supersede-grace", {"type": float,
                           "help": "seconds a namespace nobody serves waits to be superseded"}),
    ("--replay", {"action": "store_const", "const": True,
                  "help": "never generate: answer from the store or 404 not_recorded"}),
    ("--record-key", {"metavar": "SECRET",
                      "help": "sign the lines of a jsonl:// recording, refuse unsigned or "
                              "mis-signed ones (env CACHEPROXY_RECORD_KEY)"}),
    ("--upstream", {"action": "append", "metavar": "[ID=]URL",
                    "help": "generate on a running mlx_lm.server instead of in-process "
                            "(repeatable: a pool; ID=URL ties it to --model-dir ID=DIR; "
                            "env CACHEPROXY_UPSTREAM, comma-separated)"}),
    ("--model-dir", {"action": "append", "metavar": "[ID=]DIR",
                     "help": "with --upstream: the model directory the upstream serves; "
                             "repeat as ID=DIR to serve several models, each on its pool"}),
    ("--upstream-timeout", {"type": float,
                            "help": "seconds to connect to an upstream, and its longest silence"}),
    ("--log-format", {"choices": ["auto", "json", "console"]}),
    ("--log-level", {}),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheproxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cacheproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API with the cache in front")
    for flag, options in SERVE_FLAGS:
        serve.add_argument(flag, **{"dest": flag[2:].replace("-", "_"), **options})
    _add_model_commands(sub)
    _add_store_commands(sub)
    compare_run.add_parser(sub)
    return parser


def _add_model_commands(sub: Any) -> None:
    demo = sub.add_parser("demo-model", help="write a copy of the bundled demo model")
    demo.add_argument("--out", required=True, type=Path)
    demo.add_argument("--quantize", type=int, choices=[4, 8])
    demo.add_argument("--retrain", action="store_true", help="train from the recipe instead")
    demo.add_argument("--steps", type=int, help="training steps with --retrain")
    demo.add_argument("--documents", type=int,
                      help="conversations in the training corpus with --retrain")
    demo.add_argument("--batch", type=int, help="sequences per training step with --retrain")
    agent = sub.add_parser("agent-model", help="write the long-context agent model (for "
                           "agent clients: Codex, Claude Code)")
    agent.add_argument("--out", required=True, type=Path)
    agent.add_argument("--context", type=int, help="positions (default 131072)")
    agent.add_argument("--retrain", action="store_true", help="train from the recipe instead")
    agent.add_argument("--steps", type=int, help="training steps with --retrain (0: random)")
    fpr = sub.add_parser("fingerprint", help="print the pinned configuration tuple as JSON")
    fpr.add_argument("--model", help="model directory (default: the demo model)")
    fpr.add_argument("--prefill-step", type=int, help="the runner's prefill step (default 512)")
    fpr.add_argument("--decode-slots", type=int, help="the runner's decode slots (default 1)")


def _add_store_commands(sub: Any) -> None:
    st = sub.add_parser("stats", help="entries and bytes per namespace")
    st.add_argument("--store")
    st.add_argument("--json", action="store_true")
    st.add_argument("--fragile-below", type=float, metavar="GAP",
                    help="smallest near-tie margin under which an entry counts as fragile "
                         "(default 0.01)")
    st.add_argument("--fragile-sample", type=int, metavar="N",
                    help="entries per namespace read to count the fragile ones (default 1000; "
                         "0: none)")
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
    ex = sub.add_parser("export", help="write entries as JSON lines (stdout)")
    ex.add_argument("--store")
    which = ex.add_mutually_exclusive_group()
    which.add_argument("--namespace", metavar="DIGEST")
    which.add_argument("--model", dest="model_id", metavar="ID", help="the model id's namespaces")
    ex.add_argument("--out", type=Path, help="a file instead of stdout")
    ex.add_argument("--record-key", metavar="SECRET",
                    help="sign every line (HMAC-SHA256; env CACHEPROXY_RECORD_KEY)")
    im = sub.add_parser("import", help="load entries from a JSON-lines file, verified")
    im.add_argument("file", type=Path)
    im.add_argument("--store")
    im.add_argument("--model", help="model directory the entries are for (default: the demo)")
    im.add_argument("--model-id", dest="model_id")
    im.add_argument("--record-key", metavar="SECRET",
                    help="refuse lines not signed with it (env CACHEPROXY_RECORD_KEY)")
    im.add_argument("--as-current", action="store_true",
                    help="key entries of another fingerprint under the serving one")
    im.add_argument("--prefill-step", type=int, help="the serving runner's prefill step")
    im.add_argument("--decode-slots", type=int, help="the serving runner's decode slots")
    ex = sub.add_parser("explain", help="why a request misses: its key, the nearest entries "
                        "and the fields they differ in (nothing generated or stored)")
    ex.add_argument("request", type=Path, help="the request body as a client sends it (JSON)")
    ex.add_argument("--api", choices=get_args(Route),
                    default="chat", help="the API the body is for (default: chat)")
    ex.add_argument("--store")
    ex.add_argument("--model", help="model directory or repo (default: the demo model)")
    ex.add_argument("--model-id", dest="model_id")
    ex.add_argument("--api-key", default="", help="the tenant under --cache-scope per-key")
    ex.add_argument("--scan", type=int, default=2000, metavar="N",
                    help="entries of the namespace compared at most (default 2000)")
    ex.add_argument("--json", action="store_true")
    ex.add_argument("--prefill-step", type=int, help="the serving runner's prefill step")
    ex.add_argument("--decode-slots", type=int, help="the serving runner's decode slots")
    vf = sub.add_parser("verify", help="replay stored entries and compare byte for byte")
    vf.add_argument("--store")
    vf.add_argument("--model", help="model directory or repo (default: the demo model)")
    vf.add_argument("--model-id", dest="model_id")
    vf.add_argument("--namespace", metavar="DIGEST", help="default: the runner's fingerprint")
    vf.add_argument("--sample", type=int, metavar="N", help="check N random entries")
    vf.add_argument("--cross-fingerprint", action="store_true",
                    help="compare entries of another fingerprint (an upgrade audit)")
    vf.add_argument("--json", action="store_true")
    vf.add_argument("--prefill-step", type=int, help="the serving runner's prefill step")
    vf.add_argument("--prefix-cache-bytes", type=int, help="exact prefix reuse (0: off)")
    vf.add_argument("--decode-slots", type=int, help="the serving runner's decode slots")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script and of `python -m cacheproxy`: run the command,
    then leave the process with its exit status (the only place the CLI exits)."""
    try:
        code = run(argv)
    except SystemExit as exc:  # argparse: --help, --version, a usage error
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    _leave(code)


def run(argv: list[str] | None = None) -> int:
    """Run one command in this process and return its exit status (tests call this).

    A usage error raises SystemExit(2) from argparse, as it does for any argparse program."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            flags = {k: v for k, v in vars(args).items() if k != "command"}
            from cacheproxy.cli.serve import serve

            return serve(build_settings(flags, os.environ))
        if args.command == "demo-model":
            code = demo_model(args.out, args.quantize, args.retrain, args.steps,
                              args.documents, args.batch)
        elif args.command == "agent-model":
            code = agent_model(args.out, args.context, args.retrain, args.steps)
        elif args.command == "fingerprint":
            code = fingerprint(args.model, args.prefill_step, args.decode_slots)
        else:
            code = asyncio.run(_store_command(args))
    except (ValueError, FileNotFoundError, FileExistsError, UpstreamUnavailable,
            BackendError) as exc:  # a store that fails: its message, not a traceback
        print(f"cacheproxy: error: {exc}", file=sys.stderr)
        code = 2
    return code


def _leave(code: int) -> NoReturn:
    """Leave the process. One that loaded MLX leaves without the interpreter's teardown, its
    output flushed: destroying MLX's C++ state now and then aborts the process ("terminate
    called without an active exception", SIGABRT) after the work is done — seen after
    `serve` under load and after `verify` in CI, whose report was printed in full."""
    if "mlx.core" not in sys.modules:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _store_command(args: argparse.Namespace) -> int:
    from cacheproxy.cli import store as store_cli

    flags = {"store": args.store, "model": getattr(args, "model", None),
             "model_id": getattr(args, "model_id", None) if args.command != "export" else None,
             "prefill_step": getattr(args, "prefill_step", None),
             "prefix_cache_bytes": getattr(args, "prefix_cache_bytes", None),
             "record_key": getattr(args, "record_key", None),
             "decode_slots": getattr(args, "decode_slots", None)}
    settings = build_settings(flags, os.environ)
    if args.command == "stats":
        return await store_cli.stats(settings.store, as_json=args.json,
                                     fragile=_fragile(args.fragile_below, args.fragile_sample))
    if args.command == "inspect":
        return await store_cli.inspect(settings.store, args.key, as_json=args.json)
    if args.command == "purge":
        return await store_cli.purge(
            settings.store, superseded=args.superseded, namespace=args.namespace, key=args.key,
            everything=args.all, confirm=lambda what: args.yes or _ask(what))
    if args.command == "export":
        return await _export(settings, args)
    if args.command == "import":
        return await _import(settings, args)
    if args.command == "explain":
        return await _explain(settings, args)
    if args.command == "compare":
        return await compare_run.run(settings, args)
    return await _verify(settings, args)


async def _export(settings: Settings, args: argparse.Namespace) -> int:
    from cacheproxy.cli import transfer

    if args.out is None:
        await transfer.export(settings.store, namespace=args.namespace, model=args.model_id,
                              out=sys.stdout.buffer, record_key=settings.record_key.encode())
        return 0
    with args.out.open("wb") as out:
        count = await transfer.export(settings.store, namespace=args.namespace,
                                      model=args.model_id, out=out,
                                      record_key=settings.record_key.encode())
    print(f"exported {count} entries to {args.out}", file=sys.stderr)
    return 0


async def _import(settings: Settings, args: argparse.Namespace) -> int:
    from cacheproxy.cli import transfer
    from cacheproxy.keys.digests import DigestMemo
    from cacheproxy.runners.mlx import local_fingerprint, resolve_model_path

    current = local_fingerprint(settings.served_model_id,
                                resolve_model_path(settings.model_for(settings.served_model_id)),
                                prefill_step=settings.prefill_step,
                                decode_slots=settings.decode_slots,
                                memo=DigestMemo(Path(settings.digest_memo)))
    await transfer.import_(args.file, settings.store, current=current,
                           as_current=args.as_current, record_key=settings.record_key.encode())
    return 0


def _ask(what: str) -> bool:
    if not sys.stdin.isatty():
        print(f"refusing to {what} without --yes (no terminal to ask)", file=sys.stderr)
        return False
    return input(f"{what}? type 'yes' to confirm: ").strip() == "yes"


async def _explain(settings: Settings, args: argparse.Namespace) -> int:
    from cacheproxy.cli import explain
    from cacheproxy.cli.candidates import mlx_runner, started

    async with started(mlx_runner(settings, settings.model_for(settings.served_model_id))) \
            as runner:
        return await explain.run(runner, settings, args.request, api=args.api,
                                 api_key=args.api_key, scan=args.scan, as_json=args.json)


def _fragile(below: float | None, sample: int | None) -> Any:
    from cacheproxy.cli.store import Fragile

    if below is not None and below <= 0:
        raise ValueError(f"--fragile-below {below}: give a gap above 0")
    if sample is not None and sample < 0:
        raise ValueError(f"--fragile-sample {sample}: give 0 or more entries")
    return Fragile.of(below, sample)


async def _verify(settings: Settings, args: argparse.Namespace) -> int:
    from cacheproxy.cli.candidates import mlx_runner, started
    from cacheproxy.cli.verify import print_report, verify

    async with started(mlx_runner(settings, settings.model_for(settings.served_model_id))) \
            as runner:
        report = await verify(runner, settings.store, namespace=args.namespace,
                              sample=args.sample, cross_fingerprint=args.cross_fingerprint,
                              progress=not args.json)
    print_report(report, as_json=args.json)
    return 0 if not report.mismatches else 1


def demo_model(out: Path, quantize: int | None, retrain: bool, steps: int | None,
               documents: int | None, batch: int | None = None) -> int:
    """Write the demo model: a copy, a quantized copy, or a retrained one."""
    from dataclasses import replace

    from cacheproxy.runners.demo import model as dm

    if retrain:
        if quantize is not None:
            raise ValueError("--retrain and --quantize are separate steps")
        recipe = dm.Recipe()
        if steps is not None:
            recipe = replace(recipe, steps=steps)
        if documents is not None:
            recipe = replace(recipe, documents=documents)
        if batch is not None:
            recipe = replace(recipe, batch=batch)
        dm.train(out, recipe)
    else:
        if steps is not None or documents is not None or batch is not None:
            raise ValueError("--steps, --documents and --batch need --retrain")
        dm.write_copy(out, quantize=quantize)
    print(out)
    return 0


def agent_model(out: Path, context: int | None, retrain: bool, steps: int | None) -> int:
    """Write the agent model: a copy of the shipped one, or retrained from its recipe."""
    from dataclasses import replace

    from cacheproxy.runners.demo import agent

    positions = agent.CONTEXT if context is None else context
    if retrain:
        recipe = agent.AgentRecipe()
        if steps is not None:
            recipe = replace(recipe, steps=steps)
        agent.train_agent(out, recipe, context=positions)
    elif steps is not None:
        raise ValueError("--steps needs --retrain")
    else:
        agent.write_agent(out, context=positions)
    print(out)
    return 0


def fingerprint(model: str | None, prefill_step: int | None,
                decode_slots: int | None = None) -> int:
    """Print the pinned configuration tuple and its digest (as the in-process runner pins it)."""
    from cacheproxy.cli.settings import DEMO_MODEL_ID
    from cacheproxy.runners.demo.model import BUNDLED_MODEL
    from cacheproxy.runners.mlx import local_fingerprint

    path = Path(model) if model else BUNDLED_MODEL
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    from cacheproxy.runners.mlx import PREFILL_STEP

    result = local_fingerprint(model or DEMO_MODEL_ID, path,
                               prefill_step=prefill_step or PREFILL_STEP,
                               decode_slots=decode_slots or 1)
    print(json.dumps({"digest": result.digest, "fields": result.fields()}, indent=2))
    return 0
