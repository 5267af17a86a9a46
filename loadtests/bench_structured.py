"""Benchmark: constrained decoding (llguidance) against plain greedy decoding, per token.

    python loadtests/bench_structured.py            # demo model + a random-weight Llama
    python loadtests/bench_structured.py --smoke    # tiny sizes, seconds

It also runs the schema run: --schema-run prompts (100; --smoke 4) through an in-process
proxy on the demo model, each answer under a hard JSON schema (an enum, a nested object, an
array with minItems, no extra properties) validated with jsonschema. The suite runs the same
scenario (`schema_run`) on a handful of prompts (tests/e2e/test_structured.py).

In one process, through the in-process runner itself (`MlxRunner`: the lane, the chat
template, the logits processors a request gets), rounds alternate plain and constrained
generations of the same prompt on each model:
- plain: greedy, end-of-sequence blocked (logit_bias), so it runs to max_tokens;
- constrained: the same, under a 20-field JSON schema (strings unbounded, so the grammar
  is active on every token).
The figure is the median over rounds of (seconds / completion tokens), and the ratio
constrained / plain, whose target on the larger model is <= 1.2. It also times the grammar
of the 20-field schema: compiled for its first request, then reused (copied) for the next.
The larger model is a Llama of hidden 1024, 8 layers, random weights (speed does not need
quality), with the demo model's tokenizer; it is built in a temporary directory.
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

import openai  # noqa: E402

from cacheproxy.keys import grammar  # noqa: E402
from cacheproxy.keys.canonical import parse  # noqa: E402
from cacheproxy.keys.tools import schema  # noqa: E402
from cacheproxy.runners.constrain import Grammars  # noqa: E402
from cacheproxy.runners.demo.model import BUNDLED_MODEL, random_model  # noqa: E402
from cacheproxy.runners.mlx import MlxOptions, MlxRunner  # noqa: E402
from policies.sampling import SamplingMode  # noqa: E402

KINDS = ("string", "integer", "boolean")
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {f"field_{i}": {"type": KINDS[i % 3]} for i in range(20)},
    "required": [f"field_{i}" for i in range(20)]}
OUT = Path(__file__).parent / "results"
ANIMALS = ("fox", "cat", "dog", "owl", "bear", "duck", "horse", "rabbit", "frog", "mouse",
           "bird", "wolf")
ASKS = ("What does", "Where does", "What color is", "Tell me about", "Describe", "Who is",
        "What eats", "Is there", "What do you know about")
# An enum, a nested object, an array with minItems, no extra properties; strings bounded so a
# 1 M-parameter model cannot wander past max_tokens inside one.
HARD: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["animal", "food", "where", "colors"],
    "properties": {
        "animal": {"type": "string", "maxLength": 12},
        "food": {"type": "string", "enum": ["berries", "fish", "bones", "mice", "honey"]},
        "where": {"type": "object", "additionalProperties": False, "required": ["home"],
                  "properties": {"home": {"type": "string", "maxLength": 16}}},
        "colors": {"type": "array", "minItems": 2, "maxItems": 3,
                   "items": {"type": "string", "maxLength": 8}}}}


def schema_questions(n: int) -> list[str]:
    """n distinct questions about the demo model's animals: the first twelve ask about each
    animal, with every kind of question among them."""
    questions = [f"{ASKS[(i + k) % len(ASKS)]} the {animal}?"
                 for k in range(len(ASKS)) for i, animal in enumerate(ANIMALS)]
    if n > len(questions):
        raise ValueError(f"at most {len(questions)} distinct questions")
    return questions[:n]


async def schema_run(client: openai.AsyncOpenAI, model: str, questions: list[str]) -> int:
    """Ask each question under the HARD schema (thinking off); every answer must stop by
    itself and validate. Returns how many did (raises at the first that does not)."""
    import jsonschema

    valid = 0
    for question in questions:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "Hard",
                                                                    "schema": HARD}},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), HARD)
        valid += 1
    return valid


async def timed_schema_run(n: int) -> dict[str, Any]:
    """The schema run of n prompts through an in-process proxy on the demo model."""
    from aiohttp.test_utils import TestServer

    from backends import open_backend
    from cacheproxy.cli.serve import build_app
    from cacheproxy.cli.settings import Settings

    settings = Settings(store="memory://", model=str(BUNDLED_MODEL), watch=False)
    server = TestServer(build_app(settings, store=open_backend(settings.store)),
                        host="127.0.0.1", port=0)
    await server.start_server()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1",
                                api_key="unused", max_retries=0)
    try:
        started = time.perf_counter()
        valid = await schema_run(client, "cacheproxy-demo", schema_questions(n))
        seconds = time.perf_counter() - started
    finally:
        await client.close()
        await server.close()
    return {"prompts": n, "valid": valid, "seconds": round(seconds, 2)}


def big_model(work: Path, *, hidden: int, layers: int) -> Path:
    """A random-weight Llama with the demo tokenizer, saved as mlx-lm loads it."""
    return random_model(work / f"llama-{hidden}x{layers}", hidden=hidden, layers=layers)


async def _tokens_per_second(runner: MlxRunner, body: dict[str, Any]) -> float:
    parsed = parse(body, "chat", runner.defaults(), SamplingMode.FORCE_GREEDY)
    started = time.perf_counter()
    generation = runner.generate(parsed.request)
    async for _ in generation.chunks():
        pass
    seconds = time.perf_counter() - started
    assert generation.output is not None
    return seconds / max(1, generation.output.completion_tokens)


def _grammar_times(runner: MlxRunner) -> tuple[float, float]:
    """ms to compile the 20-field schema's grammar for its first request, and to get it
    for the next one (a copy of the compiled matcher), on a fresh grammar cache."""
    text = grammar.answer_grammar(json.dumps({"type": "json_schema", "schema": schema(SCHEMA)}))
    grammars = Grammars(runner.tokenizer, runner.vocab_size)
    grammars.matcher(grammar.answer_grammar('{"type": "json_object"}'))  # the tokenizer, once
    started = time.perf_counter()
    grammars.matcher(text)
    compiled = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    grammars.matcher(text)
    return compiled, (time.perf_counter() - started) * 1000


async def measure(path: Path, rounds: int, max_tokens: int) -> dict[str, Any]:
    runner = MlxRunner(MlxOptions(model=str(path), model_id="bench"))
    await runner.start()
    try:
        eos = json.loads((path / "config.json").read_text())["eos_token_id"]
        base = {"messages": [{"role": "user", "content": "Tell me about the fox."}],
                "max_tokens": max_tokens, "logit_bias": {str(t): -100 for t in eos},
                "chat_template_kwargs": {"enable_thinking": False}}
        constrained = {**base, "response_format": {"type": "json_schema", "json_schema": {
            "name": "Twenty", "schema": SCHEMA}}}
        await _tokens_per_second(runner, base)  # warm-up: compile, caches
        plain: list[float] = []
        held: list[float] = []
        for i in range(rounds):
            pair = [(plain, base), (held, constrained)]
            for into, body in pair if i % 2 == 0 else reversed(pair):
                into.append(await _tokens_per_second(runner, body))
        compile_ms, reuse_ms = _grammar_times(runner)
    finally:
        await runner.aclose()
    p, c = statistics.median(plain), statistics.median(held)
    return {"model": path.name, "rounds": rounds, "max_tokens": max_tokens,
            "plain_ms_per_token": round(p * 1000, 3),
            "constrained_ms_per_token": round(c * 1000, 3), "ratio": round(c / p, 3),
            "compile_20_fields_ms": round(compile_ms, 2), "reuse_ms": round(reuse_ms, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--schema-run", type=int, default=100,
                        help="prompts of the schema run (0: none)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 rounds, 8 tokens, hidden 128, a schema run of 4")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON is written")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.max_tokens, args.hidden, args.layers = 2, 8, 128, 2
        args.schema_run = min(args.schema_run, 4)
    with tempfile.TemporaryDirectory() as tmp:
        models = [BUNDLED_MODEL, big_model(Path(tmp), hidden=args.hidden, layers=args.layers)]
        rows = [asyncio.run(measure(m, args.rounds, args.max_tokens)) for m in models]
    rows[0]["model"] = "demo"
    schema = asyncio.run(timed_schema_run(args.schema_run)) if args.schema_run else None
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("| model | ms/token plain | ms/token constrained | ratio | target | "
              "compile 20 fields (ms) | reuse (ms) |\n|---|---:|---:|---:|---|---:|---:|")
        for r in rows:
            target = "" if r is rows[0] else ("ok (<= 1.2)" if r["ratio"] <= 1.2 else "BELOW")
            print(f"| {r['model']} | {r['plain_ms_per_token']} | "
                  f"{r['constrained_ms_per_token']} | {r['ratio']} | {target} | "
                  f"{r['compile_20_fields_ms']} | {r['reuse_ms']} |")
    if schema is not None:
        print(f"\nschema run: {schema['valid']}/{schema['prompts']} answers valid under the "
              f"hard schema ({schema['seconds']} s)")
    args.out.mkdir(exist_ok=True)
    (args.out / "bench_structured.json").write_text(json.dumps(rows, indent=2) + "\n")
    if schema is not None:
        (args.out / "schema_run.json").write_text(json.dumps(schema, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
