"""The pinned configuration tuple of the producer, and its digest.

Every field that can change a generated answer is here: engine and mlx versions,
weights content, quantization, config, tokenizer and chat template. The digest
keys every cache entry, so a change of any field makes old entries unreachable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from importlib import metadata
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from cacheproxy.keys.digests import DigestMemo, hash_files

FINGERPRINT_SCHEMA = 2  # 2: content-addressed (no model name or path in the digest)
# In the provenance, not in the digest: where the files are and what they are called do not
# produce the answer, so two proxies serving the same files share entries.
UNDIGESTED = ("model_id", "model_path")
# Fields added after entries were keyed, left out of the digest at the value that means
# "as before" (so those entries keep their keys).
DIGESTED_UNLESS = {"decode_slots": 1}
WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf", ".bin")
# generation_config.json can set eos_token_id, which decides where an answer ends.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The full pinned tuple; `digest` is what keys are namespaced by."""

    engine: str
    engine_version: str
    mlx_version: str
    model_id: str
    model_path: str
    weights_digest: str
    quantization: dict[str, Any]
    config_digest: str
    tokenizer_digest: str
    chat_template_digest: str
    adapter_digest: str
    device: str
    grammar_engine: str = ""  # what constrains decoding (structured outputs), with its version
    # Prompt tokens per prefill chunk (in-process; 0 for an upstream, whose own setting the
    # proxy cannot see): the chunk shape changes the reductions on batch-variant runtimes.
    prefill_step: int = 0
    # Rows of the pinned decode batch (in-process `--decode-slots`; 1: batch of one): the
    # batch shape changes the reductions on batch-variant runtimes.
    decode_slots: int = 1
    digest: str = field(init=False, repr=False, compare=False)
    """xxh3_128 over msgpack of the fields but UNDIGESTED; computed once (it is on every
    request's path)."""

    def __post_init__(self) -> None:
        produced = {k: v for k, v in self.fields().items() if k not in UNDIGESTED and
                    (k not in DIGESTED_UNLESS or DIGESTED_UNLESS[k] != v)}
        packed = msgpack.packb([FINGERPRINT_SCHEMA, produced], use_bin_type=True)
        object.__setattr__(self, "digest", xxhash.xxh3_128_hexdigest(packed))

    def fields(self) -> dict[str, Any]:
        """The fields as plain data (quantization keys sorted, so order never matters)."""
        out = {f.name: getattr(self, f.name) for f in dataclass_fields(self) if f.init}
        out["quantization"] = dict(sorted(self.quantization.items()))
        return out


def package_version(name: str) -> str:
    """An installed distribution's version, or 'absent'."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


@dataclass(frozen=True, slots=True)
class EngineVersions:
    """The engine versions a fingerprint pins."""

    engine_version: str
    mlx_version: str


def installed_versions() -> EngineVersions:
    """The versions of mlx-lm and mlx installed in this environment."""
    return EngineVersions(package_version("mlx-lm"), package_version("mlx"))


VersionSource = Callable[[], EngineVersions]


def weight_files(model_dir: Path) -> list[Path]:
    """Every weight file of a model directory, in name order."""
    return sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def quantization(config: dict[str, Any]) -> dict[str, Any]:
    """Bits, group size and mode; mlx-lm writes both `quantization` and `quantization_config`."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    return {
        "bits": q.get("bits"),
        "group_size": q.get("group_size"),
        "mode": q.get("mode", "affine" if q else None),
        "dtype": config.get("torch_dtype"),
    }


def chat_template_text(model_dir: Path) -> str:
    """The chat template as the tokenizer will see it (inline or a .jinja file)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    config_path = model_dir / "tokenizer_config.json"
    if config_path.exists():
        template = json.loads(config_path.read_text()).get("chat_template")
        return json.dumps(template, sort_keys=True)
    return ""


def watched_files(model_dir: Path) -> list[Path]:
    """Every file whose change changes the fingerprint."""
    names = [*CONFIG_FILES, "chat_template.jinja", *TOKENIZER_FILES]
    files = [model_dir / n for n in names if (model_dir / n).is_file()]
    return sorted(files + weight_files(model_dir))


def compute(
    model_id: str,
    model_dir: Path,
    *,
    adapter_dir: Path | None = None,
    device: str = "",
    grammar_engine: str = "",
    prefill_step: int = 0,
    decode_slots: int = 1,
    versions: VersionSource = installed_versions,
    memo: DigestMemo | None = None,
) -> Fingerprint:
    """Fingerprint a local model directory; weight digests come from the memo when unchanged."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    tokenizer_paths = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).exists()]
    template = chat_template_text(model_dir)
    adapters = sorted(adapter_dir.iterdir()) if adapter_dir else []
    engine = versions()
    return Fingerprint(
        engine="mlx-lm",
        engine_version=engine.engine_version,
        mlx_version=engine.mlx_version,
        model_id=model_id,
        model_path=str(model_dir.resolve()),
        weights_digest=hash_files(weight_files(model_dir), memo),
        quantization=quantization(config),
        config_digest=hash_files([model_dir / n for n in CONFIG_FILES
                                  if (model_dir / n).is_file()]),
        tokenizer_digest=hash_files(tokenizer_paths),
        chat_template_digest=xxhash.xxh3_128_hexdigest(template.encode()),
        adapter_digest=hash_files([p for p in adapters if p.is_file()]) if adapters else "",
        device=device,
        grammar_engine=grammar_engine,
        prefill_step=prefill_step,
        decode_slots=decode_slots,
    )
