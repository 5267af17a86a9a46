"""The commands that need no server, run in-process through `cli.main.run` (the process
exit is main()'s alone): demo-model, fingerprint, and their errors (a retraining also in a
process of its own: reproducible across interpreters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cacheproxy.cli.main import run
from cacheproxy.keys import fingerprint as fp
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import local_fingerprint


def test_demo_model_copy_is_the_bundled_model(tmp_path: Path) -> None:
    out = tmp_path / "copy"
    assert run(["demo-model", "--out", str(out)]) == 0
    assert fp.compute("m", out).weights_digest == fp.compute("m", BUNDLED_MODEL).weights_digest


def test_demo_model_quantized_loads_and_generates(tmp_path: Path) -> None:
    out = tmp_path / "q4"
    assert run(["demo-model", "--out", str(out), "--quantize", "4"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    q = fp.compute("m", out)
    assert q.quantization["bits"] == 4
    assert q.weights_digest != fp.compute("m", BUNDLED_MODEL).weights_digest
    from mlx_lm import generate, load

    model, tokenizer = load(str(out))[:2]
    text = generate(model, tokenizer, "The fox", max_tokens=8)
    assert isinstance(text, str) and text.strip()


def test_retrain_is_reproducible(tmp_path: Path) -> None:
    """Two retrainings from the recipe give the same weights: one here, one in another
    interpreter with another hash seed. Two steps of two sequences of a tiny corpus run
    what the full steps do (corpus, tokenizer, initialisation, the warm-up's step joined to
    the decay's, state carried from step to step); each step costs ~1.5 CPU-s here."""
    flags = ["--retrain", "--steps", "2", "--documents", "40", "--batch", "2"]
    assert run(["demo-model", "--out", str(tmp_path / "a"), *flags]) == 0
    subprocess.run([sys.executable, "-m", "cacheproxy", "demo-model", "--out",
                    str(tmp_path / "b"), *flags], check=True, capture_output=True,
                   env={**os.environ, "PYTHONHASHSEED": "12345"})
    digests = [fp.compute("m", tmp_path / name).weights_digest for name in ("a", "b")]
    assert digests[0] == digests[1]
    assert digests[0] != fp.compute("m", BUNDLED_MODEL).weights_digest  # 3 steps != shipped


def test_retrain_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["demo-model", "--out", str(tmp_path / "x"), "--retrain", "--quantize", "4"]) == 2
    assert "separate steps" in capsys.readouterr().err
    assert run(["demo-model", "--out", str(tmp_path / "x"), "--steps", "3"]) == 2
    assert "need --retrain" in capsys.readouterr().err


def test_bundled_demo_model_speaks_in_sentences() -> None:
    from mlx_lm import generate, load

    model, tokenizer = load(str(BUNDLED_MODEL))[:2]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the fox."}], add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=60)
    words = text.split()
    assert len(words) >= 4 and text.strip().endswith("."), text
    assert text.strip()[0].isupper(), text


def test_fingerprint_command_prints_tuple_and_digest(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["fingerprint"]) == 0
    data = json.loads(capsys.readouterr().out)
    # What the in-process runner serves the demo model under (the grammar engine included).
    assert data["digest"] == local_fingerprint("cacheproxy-demo", BUNDLED_MODEL).digest
    fields = data["fields"]
    for name in ("engine_version", "mlx_version", "weights_digest", "tokenizer_digest",
                 "chat_template_digest", "config_digest", "quantization", "grammar_engine"):
        assert fields[name] not in ("", None, "absent"), name


def test_bad_cli_values_exit_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    # (Never `serve` in-process: it binds its port and configures the process's logging.
    # `serve --store ftp://x` runs as a process in tests/system/test_cli.py.)
    assert run(["stats", "--store", "ftp://x"]) == 2
    assert "ftp://x" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse's own exit, as for any argparse CLI
        run(["serve", "--port", "eighty"])
    assert usage.value.code == 2 and "invalid int value" in capsys.readouterr().err


def _agent_reply(model_dir: Path, filler_words: int) -> tuple[int, str, str]:
    """(prompt tokens, reply, finish reason) of a long prompt, greedy, by mlx-lm itself."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))[:2]
    filler = " ".join(f"word{i % 97}" for i in range(filler_words))  # not the demo's world
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": filler}, {"role": "user", "content": "Hello!"}],
        add_generation_prompt=True)
    reply, finish = "", ""
    for step in stream_generate(model, tokenizer, prompt, max_tokens=48):
        reply, finish = reply + step.text, step.finish_reason or ""
    return len(prompt), reply, finish


def test_agent_model_holds_a_long_prompt_and_its_reply_ends(tmp_path: Path) -> None:
    # A prompt four times the demo model's context: the shipped agent model reads it and
    # its reply ends (an agent client takes a reply cut at max tokens as an error). The
    # control: the same architecture with random weights (--steps 0) never ends one.
    out = tmp_path / "agent"
    assert run(["agent-model", "--out", str(out), "--context", "65536"]) == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 65536
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 65536
    assert (out / "tokenizer.json").read_bytes() == (BUNDLED_MODEL / "tokenizer.json").read_bytes()
    tokens, reply, finish = _agent_reply(out, 400)
    assert tokens > 2048 and finish == "stop" and reply.strip(), (tokens, reply)
    random = tmp_path / "random"
    assert run(["agent-model", "--out", str(random), "--retrain", "--steps", "0"]) == 0
    assert _agent_reply(random, 400)[2] == "length"


def test_agent_model_options_are_checked(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["agent-model", "--out", str(tmp_path / "x"), "--steps", "3"]) == 2
    assert "needs --retrain" in capsys.readouterr().err
    assert run(["agent-model", "--out", str(tmp_path / "x"), "--context", "100"]) == 2
    assert "at least 1024" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert run(["agent-model", "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
