"""Exact prefix reuse (#18): time to first token and miss time per turn, reuse on vs off.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python loadtests/bench_prefix.py            # Llama 1024x8, 2,000-token system prompt
    python loadtests/bench_prefix.py --smoke         # small and quick (the test suite runs it)

A conversation of 8 turns (each prompt: the previous prompt + its reply + a new question)
runs on two in-process runners of the same random-weight model in one process, one with
exact prefix reuse on and one with it off, turn by turn side by side. Both must give the
same tokens and the same logprobs at every turn (the script fails otherwise); the table
gives each turn's prompt tokens, the tokens reused, time to first token and total miss time
on both, and their ratio; the target is a time to first token at least 5x faster at turn 8.
Also reported: the bytes each saved prompt token costs (keys and values of every layer),
and what --users more conversations that open with the same system prompt (each with a long
question of its own) add to the saved chunks, against what as many separate saved states
would hold.
Run it under OpenBLAS: that runtime is batch-variant (a reuse that is not exact shows as a
difference) and much faster than the wheel's BLAS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cacheproxy.keys.canonical import parse  # noqa: E402
from cacheproxy.runners.demo.model import random_model  # noqa: E402
from cacheproxy.runners.mlx import MlxOptions, MlxRunner  # noqa: E402
from policies.sampling import SamplingMode  # noqa: E402

OUT = Path(__file__).parent / "results"
WORDS = ("fox", "owl", "bear", "hare", "seal", "wolf", "crane", "eats", "berries", "fish",
         "mice", "grass", "lives", "in", "the", "forest", "river", "snow", "field", "is",
         "small", "big", "quick", "quiet", "at", "night", "day", "and", "a", "of", "with")
QUESTIONS = ("Tell me about the fox.", "And the owl?", "What does the bear eat?",
             "Is the seal friendly?", "Where does the wolf live?", "Which one is the biggest?",
             "What about the crane?", "Thank you, and the hare?")


def system_prompt(tokenizer: Any, tokens: int) -> str:
    """Sentences of zoo words until the prompt is `tokens` long (fixed seed)."""
    rng, text = random.Random(0), "You are the guide of a zoo. Facts:"
    while len(tokenizer.encode(text)) < tokens:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(12)) + "."
    return text


async def _turn(runner: MlxRunner, messages: list[dict[str, str]], max_tokens: int
                ) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "logprobs": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    parsed = parse(body, "chat", runner.defaults(), SamplingMode.FORCE_GREEDY)
    started = time.perf_counter()
    generation = runner.generate(parsed.request)
    first = None
    async for _ in generation.chunks():
        if first is None:
            first = time.perf_counter() - started
    total = time.perf_counter() - started
    output, prefill = generation.output, generation.prefill
    assert output is not None and prefill is not None
    text = "".join(c.text for c in output.chunks)
    logprobs = [(lp.token, lp.logprob) for c in output.chunks for lp in c.logprobs]
    return {"ttft": first if first is not None else total, "total": total, "text": text,
            "logprobs": logprobs, "prompt": prefill.total, "reused": prefill.reused}


async def shared_by_users(runner: MlxRunner, system: dict[str, str], users: int,
                          step: int, per_token: int) -> dict[str, Any]:
    """Conversations of `users` users with one system prompt and a question of about `step`
    tokens each: the bytes their saved chunks add, and what a saved state each would hold."""
    rng = random.Random(1)
    before = runner.lane_state()["prefix_bytes"]
    prompts, reused = [], []
    for user in range(users):
        question = f"I am visitor {user}. " + " ".join(rng.choice(WORDS) for _ in range(step))
        result = await _turn(runner, [system, {"role": "user", "content": question}], 1)
        prompts.append(result["prompt"])
        reused.append(result["reused"])
    added = runner.lane_state()["prefix_bytes"] - before
    separate = sum((n - 1) // step * step * per_token for n in prompts)
    return {"users": users, "prompt_tokens": prompts, "reused": reused, "bytes_added": added,
            "separate_states_bytes": separate}


async def measure(path: Path, *, system_tokens: int, turns: int, max_tokens: int,
                  step: int, users: int) -> dict[str, Any]:
    on = MlxRunner(MlxOptions(model=str(path), model_id="bench", prefill_step=step))
    off = MlxRunner(MlxOptions(model=str(path), model_id="bench", prefill_step=step,
                               prefix_cache_bytes=0))
    await on.start()
    await off.start()
    try:
        messages = [{"role": "system", "content": system_prompt(on.tokenizer, system_tokens)}]
        await _turn(on, [{"role": "user", "content": "hi"}], 2)  # warm-up: first-call costs
        await _turn(off, [{"role": "user", "content": "hi"}], 2)
        rows = []
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            pair = [off, on] if turn % 2 else [on, off]  # alternate who goes first
            results = {id(r): await _turn(r, messages, max_tokens) for r in pair}
            a, b = results[id(on)], results[id(off)]
            if (a["text"], a["logprobs"]) != (b["text"], b["logprobs"]):
                raise SystemExit(f"turn {turn + 1}: reuse changed the answer")
            rows.append({"turn": turn + 1, "prompt_tokens": a["prompt"], "reused": a["reused"],
                         "ttft_on_ms": round(a["ttft"] * 1000, 1),
                         "ttft_off_ms": round(b["ttft"] * 1000, 1),
                         "ttft_speedup": round(b["ttft"] / a["ttft"], 2),
                         "total_on_ms": round(a["total"] * 1000, 1),
                         "total_off_ms": round(b["total"] * 1000, 1),
                         "identical": True})
            messages.append({"role": "assistant", "content": a["text"]})
        state = on.lane_state()
        config = json.loads((path / "config.json").read_text())
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
        shared = await shared_by_users(on, messages[0], users, step, per_token)
    finally:
        await on.aclose()
        await off.aclose()
    return {"model": path.name, "prefill_step": step, "system_tokens": system_tokens,
            "max_tokens": max_tokens, "turns": rows,
            "blas": "openblas" if "openblas" in os.environ.get("LD_PRELOAD", "") else "wheel",
            "prefix_entries": state["prefix_entries"], "prefix_bytes": state["prefix_bytes"],
            "bytes_per_token": per_token, "shared": shared}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prefill-step", type=int, default=512)
    parser.add_argument("--users", type=int, default=4,
                        help="conversations sharing the system prompt, after the turns")
    parser.add_argument("--smoke", action="store_true", help="hidden 128, 2 layers, 3 turns")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON is written")
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.system_tokens, args.turns, args.max_tokens = \
            128, 2, 200, 3, 4
        args.prefill_step, args.users = 64, 2
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(Path(tmp) / f"llama-{args.hidden}x{args.layers}",
                             hidden=args.hidden, layers=args.layers, context=8192)
        result = asyncio.run(measure(model, system_tokens=args.system_tokens, turns=args.turns,
                                     max_tokens=args.max_tokens, step=args.prefill_step,
                                     users=args.users))
    last = result["turns"][-1]
    result["target"] = "ok (>= 5x at the last turn)" if last["ttft_speedup"] >= 5 else "BELOW"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_prefix.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['model']}, prefill step {result['prefill_step']}, {result['blas']} BLAS; "
          f"{result['bytes_per_token']} bytes per saved token; "
          f"{result['prefix_entries']} saved chunks, {result['prefix_bytes']} bytes")
    print("| turn | prompt | reused | TTFT on (ms) | TTFT off (ms) | speed-up | "
          "total on (ms) | total off (ms) | identical |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in result["turns"]:
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['reused']} | {r['ttft_on_ms']} | "
              f"{r['ttft_off_ms']} | {r['ttft_speedup']} | {r['total_on_ms']} | "
              f"{r['total_off_ms']} | yes |")
    print(f"target: {result['target']}")
    shared = result["shared"]
    print(f"{shared['users']} more users with the same system prompt (prompts "
          f"{shared['prompt_tokens']} tokens, reused {shared['reused']}): their chunks added "
          f"{shared['bytes_added']} bytes; a saved state each would hold "
          f"{shared['separate_states_bytes']} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
