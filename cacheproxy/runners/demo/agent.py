"""The agent model: room for an agent's prompt (Codex's first request is ~24k tokens of the
demo tokenizer), a prefill of it in seconds on two CPU cores, and answers that end.

A Llama with the demo's tokenizer and chat template and two layers: a sliding-window layer,
trained briefly on the demo corpus (half its conversations after a turn of noise, as an
agent's long instructions look to a tokenizer of the demo world), and a full-attention layer
that passes its input through (its output projections are zero). mlx-lm needs one
full-attention layer to serve a model with sliding windows; that layer being the last, a
prefill chunk only computes its keys and values (nothing reads its attention until the last
chunk). So the model holds 131,072
positions, reads only the last `window` tokens, and writes a demo-style reply and its end
marker after any prompt. Its words are the demo world's, out of place after an agent's
prompt: it is for testing clients (Codex, Claude Code) through the proxy, not for answers.
Its cache is a rotating one: the prefix store skips it and `--decode-slots` above 1
refuses it.

The shipped copy lives in ``data/agent-model``; `cacheproxy agent-model` writes it (with
the context asked for) or retrains it from the recipe.
"""

from __future__ import annotations

import json
import random
import shutil
import string
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cacheproxy.runners.demo import corpus as demo_corpus
from cacheproxy.runners.demo.model import BUNDLED_MODEL, Recipe, train_steps

BUNDLED_AGENT = Path(__file__).parent / "data" / "agent-model"
CONTEXT = 131072


@dataclass(frozen=True, slots=True)
class AgentRecipe:
    """Every knob of the agent model; changing one changes the weights."""

    hidden_size: int = 64
    heads: int = 2
    window: int = 128  # the tokens the model reads: the end of any prompt
    steps: int = 300
    batch: int = 4
    seq_len: int = 384  # room for a turn of noise and the conversation after it
    documents: int = 2000
    noise_chars: int = 400  # the longest turn of noise before a conversation
    learning_rate: float = 3e-3
    seed: int = 0


def agent_config(recipe: AgentRecipe, context: int = CONTEXT) -> dict[str, Any]:
    """The demo model's config.json at the agent model's shape."""
    config: dict[str, Any] = json.loads((BUNDLED_MODEL / "config.json").read_text())
    config.update(hidden_size=recipe.hidden_size, num_hidden_layers=2,
                  intermediate_size=recipe.hidden_size * 11 // 4,
                  num_attention_heads=recipe.heads, num_key_value_heads=recipe.heads,
                  max_position_embeddings=context, sliding_window=recipe.window,
                  layer_types=["sliding_attention", "full_attention"])
    return config


def _write_tokenizer(out: Path, context: int) -> None:
    shutil.copy2(BUNDLED_MODEL / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((BUNDLED_MODEL / "tokenizer_config.json").read_text())
    config["model_max_length"] = context
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _empty(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)


def _check_context(context: int) -> None:
    if context < 1024:
        raise ValueError("--context must be at least 1024 positions")


def write_agent(out: Path, *, context: int = CONTEXT) -> Path:
    """Copy the shipped agent model to ``out``, holding ``context`` positions."""
    _check_context(context)
    _empty(out)
    config = json.loads((BUNDLED_AGENT / "config.json").read_text())
    config["max_position_embeddings"] = context
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy2(BUNDLED_AGENT / "model.safetensors", out / "model.safetensors")
    _write_tokenizer(out, context)
    return out


def train_agent(out: Path, recipe: AgentRecipe = AgentRecipe(), *, context: int = CONTEXT,
                log: bool = True) -> Path:
    """Build the agent model from its recipe (steps 0: random weights) and save it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    _check_context(context)
    _empty(out)
    config = agent_config(recipe, context)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(out, context)
    mx.random.seed(recipe.seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    model.set_dtype(mx.float32)
    passing = model.model.layers[1]  # the full-attention layer: its input passes through
    for projection in (passing.self_attn.o_proj, passing.mlp.down_proj):
        projection.weight = mx.zeros_like(projection.weight)
    passing.freeze()
    if recipe.steps:
        started = time.monotonic()
        texts = agent_texts(recipe)
        train_steps(model, out, texts, _demo_recipe(recipe), log=log)
        if log:
            print(f"trained in {time.monotonic() - started:.0f}s", flush=True)
    model.unfreeze()
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


_NOISE = string.ascii_letters + string.digits + " \n<>/{}[]():;.,_-=\"'`#*"


def agent_texts(recipe: AgentRecipe) -> list[str]:
    """The demo corpus, half of it after a turn of noise (random characters, as a system,
    developer or user turn), so that a reply follows a conversation whatever came before."""
    rng = random.Random(recipe.seed)
    texts = []
    for text in demo_corpus.corpus(recipe.seed, recipe.documents):
        if rng.random() < 0.5:
            role = rng.choice(("system", "developer", "user"))
            noise = "".join(rng.choice(_NOISE) for _ in range(rng.randint(1, recipe.noise_chars)))
            text = f"<|{role}|>\n{noise}\n{text}"
        texts.append(text)
    return texts


def _demo_recipe(recipe: AgentRecipe) -> Recipe:
    """The demo trainer's recipe for the agent's run (the trainer reads steps, batch,
    sequence length, learning rate and its warm-up, and the seed)."""
    return replace(Recipe(), steps=recipe.steps, batch=recipe.batch, seq_len=recipe.seq_len,
                   learning_rate=recipe.learning_rate, warmup_steps=recipe.steps // 5,
                   documents=recipe.documents, seed=recipe.seed)
