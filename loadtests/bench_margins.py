"""Near-tie margins (#33): what measuring them costs a miss, margins on vs off, side by side.

    python loadtests/bench_margins.py              # demo model and a random Llama 1024x8
    python loadtests/bench_margins.py --smoke      # the demo model only, a few prompts

Three in-process runners of the same model in one process, two measuring margins and one not
(`MlxOptions.measure_margins`, the benchmark's switch), answer the same prompts in turns
(on, off, on again; then the other way round), the second measuring one an A/A control (how
far one configuration differs from itself here: the resolution of the figure), first with
one slot (batch of one), then with `--decode-slots S` and S prompts at once. Measuring and
not must give the same tokens (the script fails otherwise). The table gives the time per
generated token each way and the overhead, as CPU time of the process (on a shared machine the
wall time moves with the neighbours far more than the cost measured) and as wall time; the
target is under 3 % of the decode time. Whole generations are timed (prefill
included: the prompts are short), the median over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cacheproxy.cli.settings import DEMO_MODEL_ID  # noqa: E402
from cacheproxy.keys.canonical import CanonicalRequest, parse  # noqa: E402
from cacheproxy.runners.demo.model import BUNDLED_MODEL, random_model  # noqa: E402
from cacheproxy.runners.mlx import MlxOptions, MlxRunner  # noqa: E402
from policies.sampling import SamplingMode  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
PROMPTS = ["What does the fox eat?", "Tell me about the cat.", "Where does the owl live?",
           "Tell me about the fox.", "What is the weather in Lima?", "Hello!",
           "What does the duck say?", "Tell me about the wolf."]
TARGET = 0.03
VARIANTS = ("on", "off", "on again")


def _requests(runner: MlxRunner, max_tokens: int) -> list[CanonicalRequest]:
    return [parse({"model": DEMO_MODEL_ID, "max_tokens": max_tokens,
                   "messages": [{"role": "user", "content": p}]},
                  "chat", runner.defaults(), SamplingMode.FORCE_GREEDY).request
            for p in PROMPTS]


async def _answer(runner: MlxRunner, request: CanonicalRequest) -> list[int]:
    generation = runner.generate(request)
    async for _ in generation.chunks():
        pass
    if generation.output is None:
        raise RuntimeError("no output")
    return generation.output.token_ids


async def _round(runner: MlxRunner, batch: list[CanonicalRequest]
                 ) -> tuple[float, float, list[Any]]:
    """Wall and CPU seconds of one round (the CPU time of this process, every thread: on a
    shared machine it moves far less than the wall time with what the neighbours do)."""
    wall, cpu = time.perf_counter(), time.process_time()
    answers = await asyncio.gather(*(_answer(runner, r) for r in batch))
    return time.perf_counter() - wall, time.process_time() - cpu, answers


async def side_by_side(model: Path, *, slots: int, rounds: int, max_tokens: int
                       ) -> dict[str, Any]:
    """Per-token decode time with margins measured and without, alternating per round."""
    # "on", "off", and "on again": a second measuring runner, the A/A control (what the
    # same configuration differs from itself by: the resolution of this machine, now).
    runners = {name: MlxRunner(MlxOptions(model=str(model), model_id=DEMO_MODEL_ID,
                                          decode_slots=slots, prefix_cache_bytes=0,
                                          measure_margins=name != "off"))
               for name in VARIANTS}
    for r in runners.values():
        await r.start()
    try:
        requests = _requests(runners["on"], max_tokens)
        wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for n in range(rounds):
            batch = [requests[(n * slots + i) % len(requests)] for i in range(slots)]
            answers = {}
            for name in VARIANTS if n % 2 == 0 else VARIANTS[::-1]:
                seconds, cpu_seconds, answers[name] = await _round(runners[name], batch)
                tokens = sum(len(a) for a in answers[name])
                wall[name].append(seconds / tokens)
                cpu[name].append(cpu_seconds / tokens)
            if answers["on"] != answers["off"]:
                raise RuntimeError("measuring margins changed an answer")
    finally:
        for r in runners.values():
            await r.aclose()
    row: dict[str, Any] = {"slots": slots, "rounds": rounds}
    for kind, values in (("cpu", cpu), ("wall", wall)):
        m = {name: statistics.median(v) for name, v in values.items()}
        row.update({f"{kind}_on_ms": round(m["on"] * 1000, 4),
                    f"{kind}_off_ms": round(m["off"] * 1000, 4),
                    f"{kind}_overhead": round(m["on"] / m["off"] - 1, 4),
                    f"{kind}_aa": round(m["on again"] / m["on"] - 1, 4)})
    return row


async def measure(models: dict[str, Path], *, rounds: int, max_tokens: int, slots: int
                  ) -> list[dict[str, Any]]:
    """Every model, one slot and `slots` slots."""
    rows = []
    for name, path in models.items():
        for s in (1, slots):
            row = await side_by_side(path, slots=s, rounds=rounds, max_tokens=max_tokens)
            rows.append({"model": name, **row})
    return rows


def verdict(row: dict[str, Any]) -> str:
    """ok, ABOVE, or unresolved when the A/A control moved by the target or more."""
    if abs(row["cpu_aa"]) >= TARGET:
        return f"unresolved (A/A {100 * row['cpu_aa']:+.1f} %)"
    return "ok" if row["cpu_overhead"] < TARGET else "ABOVE"


def _plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\nS={r['slots']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(labels, [100 * r["cpu_overhead"] for r in rows], color="tab:blue")
    ax.axhline(100 * TARGET, color="tab:red", linestyle="--", label="target 3 %")
    ax.set_ylabel("margins: added CPU time per token (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_margins.png", dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="the demo model, 4 rounds")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.max_tokens, args.slots = 4, 8, 2
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo": BUNDLED_MODEL}
        if not args.smoke:
            name = f"llama-{args.hidden}x{args.layers}"
            models[name] = random_model(Path(tmp) / name, hidden=args.hidden,
                                        layers=args.layers)
        rows = asyncio.run(measure(models, rounds=args.rounds, max_tokens=args.max_tokens,
                                   slots=args.slots))
    args.out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["verdict"] = verdict(r)
    ok = all(r["verdict"] == "ok" for r in rows)
    (args.out / "bench_margins.json").write_text(json.dumps(
        {"rows": rows, "target": TARGET, "ok": ok}, indent=2) + "\n")
    _plot(rows, args.out)
    print("| model | slots | CPU on (ms/token) | CPU off | CPU overhead | CPU A/A | wall on | "
          "wall off | wall overhead | wall A/A | verdict |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['slots']} | {r['cpu_on_ms']} | {r['cpu_off_ms']} | "
              f"{100 * r['cpu_overhead']:+.2f} % | {100 * r['cpu_aa']:+.2f} % | "
              f"{r['wall_on_ms']} | {r['wall_off_ms']} | {100 * r['wall_overhead']:+.2f} % | "
              f"{100 * r['wall_aa']:+.2f} % | {r['verdict']} |")
    print(f"target (CPU time < {100 * TARGET:.0f} % of the decode time, where the A/A control "
          f"resolves it): {', '.join(sorted({r['verdict'] for r in rows}))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
