"""Loading a model for the in-process runner: its options, what one load produces (model,
tokenizer, defaults, fingerprint, grammars, prefix store), and the fingerprint it is served
under (also computed without loading it, for `cacheproxy fingerprint` and `import`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cacheproxy.keys import fingerprint as fp
from cacheproxy.keys.canonical import RunnerDefaults
from cacheproxy.keys.digests import DigestMemo
from cacheproxy.keys.grammar import engine_version
from cacheproxy.runners import prefix, rows
from cacheproxy.runners.chat import template_defaults, thinking_kwarg
from cacheproxy.runners.constrain import Grammars
from cacheproxy.runners.prefiller import ModelFilesMoved, PrefillProcess
from cacheproxy.runners.watcher import Snapshot, snapshot

PREFILL_STEP = 512  # mlx-lm's chunk of prompt tokens per prefill step (the default setting)
PREFIX_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class MlxOptions:
    """Knobs of the in-process runner."""

    model: str
    model_id: str
    queue_size: int = 64
    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    device_scope: bool = False
    digest_memo: Path | None = None
    prefill_step: int = PREFILL_STEP  # changes answers on batch-variant runtimes: pinned
    prefix_cache_bytes: int = PREFIX_CACHE_BYTES  # 0: every prefill cold (never changes one)
    decode_slots: int = 1  # rows of the pinned decode batch (1: batch of one): pinned
    # With S > 1, prefill in a process of its own (`prefiller`): the same bits, not slowed
    # by (nor slowing) the decode steps; False prefills on a thread beside them.
    prefill_process: bool = True
    # M = the rows in use instead of S: a diagnostic for the exactness test's control only
    # (its answers depend on the neighbours); no setting reaches it.
    unpinned_decode: bool = False
    note_queueing: bool = False  # log when misses queue behind a one-slot lane (serve does)
    # Near-tie margins of every answer (`runners.margins`); off only for the benchmark that
    # measures what they cost (loadtests/bench_margins.py): no setting reaches it.
    measure_margins: bool = True


@dataclass(frozen=True, slots=True)
class Loaded:
    """Everything one load produced; swapped in as a whole, so a failed load changes nothing."""

    model: Any
    tokenizer: Any
    defaults: RunnerDefaults
    fingerprint: fp.Fingerprint
    snapshot: Snapshot
    grammars: Grammars
    prefixes: prefix.PrefixStore | None  # None: off, or a cache this reuse cannot cut
    prefiller: PrefillProcess | None = None  # S > 1's prefill process (ended with the model)


class ModelChanging(Exception):
    """The model's files changed during a load; the watcher retries once they are stable."""


def local_fingerprint(model_id: str, path: Path, *, device: str = "",
                      prefill_step: int = PREFILL_STEP, decode_slots: int = 1,
                      versions: fp.VersionSource = fp.installed_versions,
                      memo: DigestMemo | None = None) -> fp.Fingerprint:
    """The fingerprint the in-process runner serves a model directory under (without
    loading it: `cacheproxy fingerprint` and `import` compute the same)."""
    return fp.compute(model_id, path, device=device, grammar_engine=engine_version(),
                      prefill_step=prefill_step, decode_slots=decode_slots,
                      versions=versions, memo=memo)


def resolve_model_path(model: str) -> Path:
    """A local directory as is; otherwise a Hugging Face repo through mlx-lm's own download."""
    path = Path(model).expanduser()
    if path.exists():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return path
    if model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {model} does not exist")
    from mlx_lm.utils import _download

    return Path(_download(model))


def load_model(options: MlxOptions, path: Path, *, versions: fp.VersionSource,
               memo: DigestMemo) -> Loaded:
    """Load a model directory as the runner serves it (on the lane thread); a model that
    --decode-slots S > 1 cannot batch is refused (`rows.check`)."""
    # The prefill process loads beside this one (on another core) and is checked at the end.
    prefiller = PrefillProcess(path) if options.decode_slots > 1 and options.prefill_process \
        else None
    try:
        loaded = _load(options, path, versions=versions, memo=memo)
        if prefiller is not None:
            try:
                prefiller.wait_loaded(loaded.snapshot)
            except ModelFilesMoved as exc:  # the watcher loads them again once stable
                raise ModelChanging(exc.detail) from exc
    except BaseException:
        if prefiller is not None:
            prefiller.close()
        raise
    return replace(loaded, prefiller=prefiller)


def _load(options: MlxOptions, path: Path, *, versions: fp.VersionSource,
          memo: DigestMemo) -> Loaded:
    from mlx_lm import load

    before = snapshot(path)
    loaded = load(str(path))
    model, tokenizer = loaded[0], loaded[1]
    if options.decode_slots > 1:
        rows.check(model, options.decode_slots)  # refuses what it cannot batch
    config = json.loads((path / "config.json").read_text())
    context = int(
        config.get("max_position_embeddings")
        or getattr(tokenizer, "model_max_length", 0)
        or 4096
    )
    defaults = RunnerDefaults(
        model_id=options.model_id,
        aliases=frozenset({options.model, str(path)}),
        max_tokens=min(options.default_max_tokens, context),
        max_tokens_cap=options.max_tokens_cap,
        context_length=context,
        vocab_size=int(config["vocab_size"]) if "vocab_size" in config else None,
        template_kwargs=template_defaults(tokenizer),
        thinking_kwarg=thinking_kwarg(tokenizer),
        tool_calling=bool(tokenizer.has_tool_calling),
        tool_format=str(tokenizer.init_kwargs.get("tool_parser_type") or ""),
        grammar_engine=engine_version(),
    )
    device = _device() if options.device_scope else ""
    fingerprint = local_fingerprint(options.model_id, path, device=device,
                                    prefill_step=options.prefill_step,
                                    decode_slots=options.decode_slots,
                                    versions=versions, memo=memo)
    if snapshot(path) != before:
        raise ModelChanging(f"the files of {path} changed while loading")
    grammars = Grammars(tokenizer, int(config.get("vocab_size") or len(tokenizer.vocab)))
    return Loaded(model, tokenizer, defaults, fingerprint, before, grammars,
                  _prefix_store(options, model))


def _prefix_store(options: MlxOptions, model: Any) -> prefix.PrefixStore | None:
    from mlx_lm.models.cache import make_prompt_cache

    if options.prefix_cache_bytes <= 0 or not prefix.supports(make_prompt_cache(model)):
        return None
    return prefix.PrefixStore(options.prefill_step, options.prefix_cache_bytes)


def _device() -> str:
    import platform

    import mlx.core as mx

    return f"{platform.system()}-{platform.machine()}-{mx.default_device()}"
