"""Weight-file digests: content hashes remembered per (path, size, mtime_ns, inode)."""

from __future__ import annotations

import os
from pathlib import Path

from cacheproxy.keys import fingerprint as fp
from cacheproxy.keys.digests import DigestMemo, hash_file
from cacheproxy.runners.demo.model import write_copy


def test_memo_hashes_a_file_once_per_version(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 1000)
    memo_file = tmp_path / "cache" / "digests.json"
    first = DigestMemo(memo_file)
    digest = first.digest(weights)
    assert first.hashed == [str(weights)] and digest == hash_file(weights)

    again = DigestMemo(memo_file)  # a new process reads the side file
    assert again.digest(weights) == digest and again.hashed == []

    weights.write_bytes(b"b" * 1000)  # same size, new content and mtime
    os.utime(weights, ns=(1, 1))
    changed = again.digest(weights)
    assert changed != digest and again.hashed == [str(weights)]


def test_a_broken_memo_file_is_an_empty_memo(tmp_path: Path) -> None:
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x")
    memo_file = tmp_path / "digests.json"
    memo_file.write_text("{not json")
    memo = DigestMemo(memo_file)
    assert memo.digest(weights) == hash_file(weights) and memo.hashed == [str(weights)]


def test_fingerprint_uses_the_memo_and_sees_every_field(tmp_path: Path) -> None:
    model = write_copy(tmp_path / "m")
    memo = DigestMemo(tmp_path / "digests.json")
    a = fp.compute("demo", model, memo=memo)
    b = fp.compute("demo", model, memo=DigestMemo(tmp_path / "digests.json"))
    assert a == b and memo.hashed == [str(model / "model.safetensors")]
    (model / "tokenizer_config.json").write_text(
        (model / "tokenizer_config.json").read_text().replace("<|assistant|>", "<|bot|>"))
    c = fp.compute("demo", model, memo=memo)
    assert c.chat_template_digest != a.chat_template_digest and c.digest != a.digest
    assert c.weights_digest == a.weights_digest
