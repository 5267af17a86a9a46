"""The model directory an upstream pool serves: its options, defaults and fingerprint.

The upstream runner never loads the weights (mlx_lm.server does); it fingerprints the
directory's files and reads the config, and the engine fields of the fingerprint come from
the upstreams' `system_fingerprint` (filled in by the runner).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cacheproxy.keys import fingerprint as fp
from cacheproxy.keys.canonical import RunnerDefaults
from cacheproxy.keys.digests import DigestMemo
from cacheproxy.runners.chat import template_defaults, thinking_kwarg
from cacheproxy.runners.mlx import ModelChanging
from cacheproxy.runners.watcher import Snapshot, snapshot


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamOptions:
    """Knobs of the upstream runner. Times are float seconds."""

    urls: tuple[str, ...]
    model_dir: Path
    model_id: str
    queue_size: int = 64
    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    device_scope: bool = False
    digest_memo: Path | None = None
    timeout: float = 30.0  # to connect, and the longest silence inside an answer
    health_interval: float = 5.0
    backoff: tuple[float, float] = (0.25, 10.0)  # first and longest retry delay of a dead member


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """The model directory as last fingerprinted (its engine fields are filled in later)."""

    fingerprint: fp.Fingerprint
    defaults: RunnerDefaults
    snapshot: Snapshot
    call_markers: tuple[str, str] = ("", "")  # the template's tool-call opening and closing
    # The tokenizer as mlx_lm.server loads it (count_tokens renders prompts with it).
    tokenizer: Any = field(default=None, compare=False, repr=False)


def read_model_files(options: UpstreamOptions, memo: DigestMemo) -> ModelFiles:
    """Fingerprint the model directory and read its defaults (in a thread: it hashes).

    The tokenizer is loaded the way mlx_lm.server loads it, for what the canonical request
    fills in for the upstream: the template's thinking default and whether tool calls parse.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model_dir = options.model_dir
    before = snapshot(model_dir)
    tokenizer = load_tokenizer(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    context = int(config.get("max_position_embeddings") or 4096)
    defaults = RunnerDefaults(
        model_id=options.model_id,
        aliases=frozenset({str(model_dir), str(model_dir.resolve())}),
        max_tokens=min(options.default_max_tokens, context),
        max_tokens_cap=options.max_tokens_cap,
        context_length=context,
        vocab_size=int(config["vocab_size"]) if "vocab_size" in config else None,
        template_kwargs=template_defaults(tokenizer),
        thinking_kwarg=thinking_kwarg(tokenizer),
        tool_calling=bool(tokenizer.has_tool_calling),
        validates_schemas=True,  # mlx_lm.server ignores response_format: answers are checked
    )
    files = fp.compute(options.model_id, model_dir, memo=memo)
    if snapshot(model_dir) != before:
        raise ModelChanging(f"the files of {model_dir} changed while fingerprinting")
    markers = (tokenizer.tool_call_start or "", tokenizer.tool_call_end or "")
    return ModelFiles(files, defaults, before, markers, tokenizer)
