"""The small demo model the embedded default serves: built, trained and saved by this code.

The shipped copy lives in ``cacheproxy/runners/demo/data/demo-model``. ``cacheproxy demo-model``
writes a copy of it, a quantized copy (through mlx-lm's own convert API), or a
freshly trained one (same recipe, fixed steps and seeds: identical weights on the
same machine and runtime).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheproxy.runners.demo import corpus as demo_corpus
from cacheproxy.runners.demo import template

BUNDLED_MODEL = Path(__file__).parent / "data" / "demo-model"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class Recipe:
    """Every knob of the training run; changing one changes the weights."""

    vocab_size: int = 1024
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 384
    context: int = 512
    steps: int = 1500
    batch: int = 16
    seq_len: int = 288
    # A linear warm-up, then a cosine decay to a tenth. Without the warm-up (the first
    # recipe: 3e-3 from step 0) the model never learned to attend: it wrote the same city
    # and animal whatever the prompt named; with it, it copies them after ~300 steps.
    learning_rate: float = 1e-3
    warmup_steps: int = 150
    documents: int = 12000
    seed: int = 0


def model_config(recipe: Recipe, eos_ids: list[int]) -> dict[str, object]:
    """The config.json of a Llama-architecture model of the recipe's size."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": recipe.hidden_size,
        "num_hidden_layers": recipe.layers,
        "intermediate_size": recipe.intermediate_size,
        "num_attention_heads": recipe.heads,
        "num_key_value_heads": recipe.heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": recipe.vocab_size,
        "max_position_embeddings": recipe.context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": eos_ids,
    }


def train_tokenizer(recipe: Recipe, texts: list[str], out: Path) -> list[int]:
    """Train a byte-level BPE tokenizer on the corpus; return the eos ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # A space is a token of its own: " Paris" in a question and "Paris" in a call's arguments
    # are then one token, so a small model learns to copy it (not to map one onto another).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(" "), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=list(template.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": template.END,
        "pad_token": template.END,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": recipe.context,
        "chat_template": template.CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # The next turn's marker ends a reply: the model writes it after every answer.
    ids = [tok.token_to_id(marker) for marker in template.EOS]
    return [i for i in ids if i is not None]


def train(out: Path, recipe: Recipe = Recipe(), *, log: bool = True) -> Path:
    """Train the demo model from its recipe and save it to ``out``."""
    import mlx.core as mx
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    texts = demo_corpus.corpus(recipe.seed, recipe.documents)
    eos_ids = train_tokenizer(recipe, texts, out)
    config = model_config(recipe, eos_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.random.seed(recipe.seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    model.set_dtype(mx.float32)
    train_steps(model, out, texts, recipe, log=log)
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def schedule(recipe: Recipe) -> Any:
    """The learning rate per step: a linear warm-up, then a cosine decay to a tenth."""
    import mlx.optimizers as optim

    peak, warmup = recipe.learning_rate, min(recipe.warmup_steps, recipe.steps // 2)
    decay = optim.cosine_decay(peak, max(recipe.steps - warmup, 1), peak / 10)
    if warmup == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(peak / 100, peak, warmup), decay],
                                [warmup])


def train_steps(model: Any, out: Path, texts: list[str], recipe: Recipe, *, log: bool) -> None:
    """AdamW on windows of the texts' tokens, on the recipe's schedule."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    stream, starts = _token_stream(out, texts, recipe.seq_len)
    optimizer = optim.AdamW(learning_rate=schedule(recipe), weight_decay=0.01)
    steps = recipe.steps

    def loss_fn(m: Any, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    step_fn = nn.value_and_grad(model, loss_fn)  # type: ignore[attr-defined]
    rng = np.random.default_rng(recipe.seed)
    started = time.monotonic()
    for step in range(steps):
        # Windows start where documents start: a conversation is seen from its beginning
        # (its tools block included), as it is served.
        begin = rng.choice(starts, size=recipe.batch)
        window = np.stack([stream[s : s + recipe.seq_len + 1] for s in begin])
        x, y = mx.array(window[:, :-1]), mx.array(window[:, 1:])
        loss, grads = step_fn(model, x, y)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        if log and (step % 50 == 0 or step == steps - 1):
            elapsed = time.monotonic() - started
            print(f"step {step:4d}  loss {loss.item():.3f}  {elapsed:.0f}s", flush=True)


def _token_stream(out: Path, texts: list[str], seq_len: int) -> tuple[Any, Any]:
    """Every document's tokens end to end, and where each document starts (those that have
    a whole window after them)."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    encoded = [enc.ids for enc in tok.encode_batch(texts)]
    offsets = np.cumsum([0] + [len(ids) for ids in encoded])
    stream = np.array([i for ids in encoded for i in ids], dtype=np.int32)
    return stream, offsets[:-1][offsets[:-1] < len(stream) - seq_len - 1]


def write_copy(out: Path, *, quantize: int | None = None) -> Path:
    """Copy the bundled model to ``out``, optionally quantized with mlx-lm's convert."""
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    if quantize is None:
        out.mkdir(parents=True, exist_ok=True)
        for name in MODEL_FILES:
            shutil.copy2(BUNDLED_MODEL / name, out / name)
        return out
    if quantize not in (4, 8):
        raise ValueError("quantize must be 4 or 8")
    from mlx_lm import convert

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if out.exists():
        out.rmdir()
    convert(str(BUNDLED_MODEL), str(out), quantize=True, q_bits=quantize, q_group_size=64)
    return out


def random_model(out: Path, *, hidden: int, layers: int, heads: int = 16,
                 context: int = 2048, seed: int = 0) -> Path:
    """A Llama of another size with random weights and the demo's tokenizer and template,
    saved as mlx-lm loads it: for benchmarks (speed needs no quality) and for tests that
    need a model whose reductions vary with the chunk shape."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads, intermediate_size=hidden * 11 // 4,
                  max_position_embeddings=context)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, out / name)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    model.set_dtype(mx.float32)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out
