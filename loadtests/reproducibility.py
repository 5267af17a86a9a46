"""How often does the same prompt give the same answer? Directly vs through cacheproxy.

An experiment, not a test. On 127.0.0.1 it starts a batching `python -m mlx_lm.server` on a
copy of the demo model (under the chosen BLAS) and sends N fixed prompts (questions about the
demo model's animals), each repeated R times, under four configurations (`--configs` picks some):

  t0.7 unseeded      temperature 0.7, no seed, one request at a time
  t0.7 seed          temperature 0.7, seed 1234, one request at a time
  t0 sequential      temperature 0, one request at a time
  t0 concurrent      temperature 0, all N prompts in flight together each round, so
                     mlx_lm.server batches them with different neighbours every round

Rounds interleave the prompts (shuffled with a fixed seed per round). Each configuration runs
twice: directly (with `logprobs: true`, so per-token logprobs are compared too) and through
`cacheproxy serve --upstream <that server> --store memory:// --sampling seeded` (a fresh
proxy per configuration; `seeded` caches greedy and seeded requests and passes unseeded
sampling through uncached as BYPASS; logprobs are unsupported in upstream mode, so the proxy
column compares text only). Metric: the fraction of repeat pairs (R*(R-1)/2 per prompt)
whose generations are byte-identical (and whose logprob lists are bit-identical). Failed
requests are left out of the pairs and counted per cell by kind ("HTTP 503 overloaded",
"ClientOSError: Connection reset by peer", "TimeoutError", ...): the table, the JSON
(`error_kinds`) and the per-cell log line on stderr name them.

    python loadtests/reproducibility.py                        # wheel BLAS, 100 x 10
    python loadtests/reproducibility.py --blas wheel,openblas  # both runtimes side by side
    python loadtests/reproducibility.py --smoke --out /tmp/r   # 4 x 3, a few seconds
    python loadtests/reproducibility.py --configs "t0 sequential,t0 concurrent"  # two of the four

Prints a Markdown table and writes reproducibility.png (and .json) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import aiohttp
from common import (
    PATH,
    RESULTS,
    animal_prompts,
    children,
    demo_model,
    figure,
    run,
    runtime_line,
    save,
    start_proxy,
    start_upstream,
    table,
)

SEED = 1234
CONFIGS: dict[str, dict[str, Any]] = {
    "t0.7 unseeded": {"temperature": 0.7},
    "t0.7 seed": {"temperature": 0.7, "seed": SEED},
    "t0 sequential": {"temperature": 0.0},
    "t0 concurrent": {"temperature": 0.0},
}
CONCURRENT = {"t0 concurrent"}
PROXY_SAMPLING = "seeded"


@dataclass
class Result:
    """One (BLAS, configuration, path) cell."""

    blas: str
    config: str
    path: str  # direct | proxy
    text_rate: float
    logprob_rate: float | None
    prompts_all_same: int
    prompts: int
    seconds: float
    x_cache: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)


class HTTPStatus(Exception):
    """A non-200 answer: its status and the error code of its JSON body, if any."""

    def __init__(self, status: int, data: Any) -> None:
        code = ""
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            code = str(data["error"].get("code") or data["error"].get("type") or "")
        self.kind = f"HTTP {status}" + (f" {code}" if code else "")
        super().__init__(f"{status}: {str(data)[:300]}")


def error_kind(exc: BaseException) -> str:
    """A short label grouping failures of the same cause."""
    if isinstance(exc, HTTPStatus):
        return exc.kind
    if isinstance(exc, TimeoutError):  # aiohttp's total timeout raises this too
        return "TimeoutError (client timeout)"
    if isinstance(exc, OSError) and exc.strerror:  # ClientOSError: Connection reset by peer
        return f"{type(exc).__name__}: {exc.strerror}"
    text = str(exc).split("\n")[0][:80]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class Measured:
    """What one configuration got: per prompt index, its texts and logprob lists in order."""

    texts: dict[int, list[Any]]
    logprobs: dict[int, list[Any]]
    caches: dict[str, int]  # X-Cache value -> count ('-' when absent)
    error_kinds: dict[str, int]  # error_kind() -> count


def pair_rate(samples: dict[int, list[Any]]) -> float:
    same = total = 0
    for values in samples.values():
        for a, b in combinations(values, 2):
            total += 1
            same += a == b
    return same / total if total else float("nan")


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
              ) -> tuple[str, Any, str]:
    async with session.post(url, json=body) as resp:
        raw = await resp.read()
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw[:300].decode(errors="replace")
        if resp.status != 200:
            raise HTTPStatus(resp.status, data)
        choice = data["choices"][0]
        logprobs = choice.get("logprobs")
        tokens = None
        if logprobs:  # exact floats as sent: repr of the JSON numbers round-trips
            tokens = [(t.get("id"), t.get("logprob")) for t in logprobs.get("content", [])]
        return choice["message"]["content"], tokens, resp.headers.get("X-Cache", "")


async def measure(url: str, model: str, config: str, prompts: list[str], repeats: int,
                  max_tokens: int, logprobs: bool) -> Measured:
    texts: dict[int, list[Any]] = {i: [] for i in range(len(prompts))}
    lps: dict[int, list[Any]] = {i: [] for i in range(len(prompts))}
    caches: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for r in range(repeats):
            order = list(range(len(prompts)))
            random.Random(r).shuffle(order)

            def body(i: int) -> dict[str, Any]:
                b = {"model": model, "max_tokens": max_tokens, **CONFIGS[config],
                     "messages": [{"role": "user", "content": prompts[i]}]}
                return b | ({"logprobs": True} if logprobs else {})

            if config in CONCURRENT:
                outs = await asyncio.gather(*(one(session, url, body(i)) for i in order),
                                            return_exceptions=True)
            else:
                outs = []
                for i in order:
                    try:
                        outs.append(await one(session, url, body(i)))
                    except Exception as exc:  # noqa: BLE001  (counted by kind, not fatal)
                        outs.append(exc)
            for i, out in zip(order, outs, strict=True):
                if isinstance(out, BaseException):
                    if isinstance(out, (KeyboardInterrupt, SystemExit)):
                        raise out
                    kinds[error_kind(out)] += 1
                    print(f"  error (round {r}): {error_kind(out)}: {str(out)[:200]}",
                          file=sys.stderr)
                    continue
                texts[i].append(out[0])
                lps[i].append(out[1])
                caches[out[2].split(";")[0] or "-"] += 1
    return Measured(texts, lps, dict(caches), dict(kinds))


def cell(blas: str, config: str, path: str, started: float,
         measured: Measured, logprobs: bool) -> Result:
    texts, lps = measured.texts, measured.logprobs
    all_same = sum(1 for v in texts.values() if v and len(set(v)) == 1)
    res = Result(blas, config, path, pair_rate(texts), pair_rate(lps) if logprobs else None,
                 all_same, len(texts), round(time.monotonic() - started, 1),
                 measured.caches, sum(measured.error_kinds.values()), measured.error_kinds)
    lp = "-" if res.logprob_rate is None else f"{res.logprob_rate:.3f}"
    print(f"  {blas:8} {path:6} {config:14} text {res.text_rate:.3f} logprobs {lp} "
          f"({res.seconds} s, X-Cache {res.x_cache}, errors {res.errors} {res.error_kinds})",
          file=sys.stderr, flush=True)
    return res


def run_blas(args: argparse.Namespace, work: Path, blas: str) -> list[Result]:
    prompts = animal_prompts(args.prompts)
    results: list[Result] = []
    with children() as procs:
        model_dir = demo_model(work)
        upstream = start_upstream(procs, work, model_dir, blas=blas)
        for config in args.configs:
            t0 = time.monotonic()
            got = asyncio.run(measure(upstream.url + PATH, "default_model", config, prompts,
                                      args.repeats, args.max_tokens, True))
            results.append(cell(blas, config, "direct", t0, got, True))
        for config in args.configs:  # a fresh proxy (empty store) per configuration
            proxy = start_proxy(procs, work, "--upstream", upstream.url, "--model-dir",
                                str(model_dir), "--model-id", "demo", "--store", "memory://",
                                "--sampling", PROXY_SAMPLING, "--queue-size", "1024")
            t0 = time.monotonic()
            got = asyncio.run(measure(proxy.url + PATH, "demo", config, prompts, args.repeats,
                                      args.max_tokens, False))
            results.append(cell(blas, config, "proxy", t0, got, False))
            proxy.kill(15)
    return results


def markdown(results: list[Result], args: argparse.Namespace) -> str:
    by = {(r.blas, r.config, r.path): r for r in results}
    rows = []
    for blas in args.blas:
        for config in args.configs:
            d, p = by[(blas, config, "direct")], by[(blas, config, "proxy")]
            rows.append([blas, config, f"{d.text_rate:.3f}", f"{d.logprob_rate:.3f}",
                         f"{d.prompts_all_same}/{d.prompts}", f"{p.text_rate:.3f}",
                         f"{p.prompts_all_same}/{p.prompts}",
                         ", ".join(f"{k} {v}" for k, v in sorted(p.x_cache.items())),
                         kinds_text(d), kinds_text(p)])
    head = (f"{args.prompts} prompts x {args.repeats} repeats, max_tokens {args.max_tokens}; "
            f"proxy: --sampling {PROXY_SAMPLING}, memory store, text only (no logprobs in "
            f"upstream mode); rate = fraction of identical repeat pairs\n\n")
    return head + table(
        ["BLAS", "configuration", "direct text", "direct logprobs", "direct prompts all same",
         "proxy text", "proxy prompts all same", "proxy X-Cache", "direct errors",
         "proxy errors"], rows, "ll")


def kinds_text(res: Result) -> str:
    """'0', or the count and its kinds: '28 (ClientOSError: Connection reset by peer 28)'."""
    if not res.errors:
        return "0"
    return f"{res.errors} (" + ", ".join(f"{k} {v}" for k, v in
                                        sorted(res.error_kinds.items())) + ")"


def plot(results: list[Result], args: argparse.Namespace) -> Path:
    fig, axes = figure(1, len(args.blas), (6 * len(args.blas), 4))
    for ax, blas in zip(axes[0], args.blas, strict=True):
        names = args.configs
        xs = range(len(names))
        for k, (path, key, label) in enumerate([("direct", "text_rate", "direct text"),
                                                 ("direct", "logprob_rate", "direct logprobs"),
                                                 ("proxy", "text_rate", "cacheproxy text")]):
            vals = [getattr(next(r for r in results if r.blas == blas and r.config == c
                                 and r.path == path), key) for c in names]
            ax.bar([x + (k - 1) * 0.27 for x in xs], vals, 0.27, label=label)
        ax.set_xticks(list(xs), names, rotation=15)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("identical repeat pairs")
        ax.set_title(f"BLAS: {blas}")
        ax.legend(loc="lower left", fontsize=8)
    return save(fig, args.out / "reproducibility.png")


def main(args: argparse.Namespace) -> int:
    print(f"runtime: {runtime_line()}", file=sys.stderr)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="lt_repro_") as tmp:
        for blas in args.blas:
            results += run_blas(args, Path(tmp), blas)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reproducibility.json").write_text(json.dumps(
        {"runtime": runtime_line(), "results": [asdict(r) for r in results]}, indent=1))
    plot(results, args)
    print(markdown(results, args))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blas", default="wheel", help="wheel, openblas or both comma-separated")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated configurations (default: all four)")
    p.add_argument("--smoke", action="store_true", help="4 prompts x 3 repeats")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the PNG and JSON")
    args = p.parse_args(argv)
    args.configs = list(dict.fromkeys(c.strip() for c in args.configs.split(",") if c.strip()))
    if not args.configs or set(args.configs) - set(CONFIGS):
        p.error(f"--configs: a comma-separated choice of {', '.join(CONFIGS)}")
    if args.smoke:
        args.prompts, args.repeats = 4, 3
    args.blas = [b.strip() for b in args.blas.split(",") if b.strip()]
    if args.prompts < 1 or args.repeats < 2:
        p.error("--prompts >= 1 and --repeats >= 2")
    return args


if __name__ == "__main__":
    sys.exit(run(main, parse_args(), "reproducibility"))
