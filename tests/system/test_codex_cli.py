"""Codex CLI (npm `@openai/codex`, `wire_api = "responses"`) driven as its users drive it:
`codex exec` on a one-line task in a scratch git repository, its config.toml pointing a local
provider at the proxy, which serves the agent model (its ~24k-token first request does not
fit the demo model). The run completes, and an identical second run is a HIT on the proxy;
the same task in another checkout is not (Codex's prompt holds its working directory).

One test, under OpenBLAS (the prefill of Codex's prompt takes ~2 s there, ~6 s without).
Skipped only when the npm package is not installed (`.ci/run` installs it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cacheproxy.cli.main import run
from tests.harness.processes import openblas_env, serving
from tests.harness.repos import scratch_repo

pytestmark = pytest.mark.xdist_group("codex")
KEY = "sk-local-codex"
README = Path(__file__).resolve().parents[2] / "README.md"
SCRATCH = "A scratch repository.\n"  # the README of the checkout Codex runs in


def _readme_config(url: str) -> str:
    """The README's config.toml for Codex, pointed at this proxy (so the two never part)."""
    text = README.read_text().split("### Codex CLI", 1)[1]
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8080/v1" in block
    # (Offline: no update check; a root key, so before the tables.)
    return "check_for_update_on_startup = false\n" + block.replace("http://127.0.0.1:8080", url)


def _codex() -> str:
    found = shutil.which("codex")
    if found is None:
        pytest.skip("the npm package @openai/codex is not installed "
                    "(`npm install -g @openai/codex@0.171.0`, as .ci/run does)")
    return found


def _exec(codex: str, home: Path, repo: Path, answer: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CODEX_HOME": str(home), "CACHEPROXY_API_KEY": KEY}
    return subprocess.run([codex, "exec", "-o", str(answer), "Say hello."], cwd=repo, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)


def _responses_lines(log: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("path") == "/v1/responses"]


def test_codex_exec_completes_and_its_rerun_is_a_hit(tmp_path: Path) -> None:
    codex = _codex()
    model = tmp_path / "agent"
    assert run(["agent-model", "--out", str(model)]) == 0
    home, repo = tmp_path / "codex-home", scratch_repo(tmp_path / "repo", SCRATCH)
    home.mkdir()
    output: list[str] = []
    with serving("--model", str(model), "--model-id", "agent", "--store", "memory://",
                 "--no-watch", "--api-key", KEY, "--log-format", "json",
                 env=openblas_env(), output=output) as url:
        (home / "config.toml").write_text(_readme_config(url))
        runs = [_exec(codex, home, repo, tmp_path / f"answer-{i}.txt") for i in (1, 2)]
        # The control, and what the README says of hit rates: Codex writes the working
        # directory into its prompt, so the same task in another checkout is another entry.
        runs.append(_exec(codex, home, scratch_repo(tmp_path / "elsewhere", SCRATCH),
                          tmp_path / "answer-3.txt"))
    for done in runs:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "ERROR" not in done.stderr, done.stderr[-3000:]
    answers = [(tmp_path / f"answer-{i}.txt").read_text() for i in (1, 2)]
    assert answers[0].strip() and answers[0] == answers[1]
    lines = _responses_lines(output[0])
    assert [(line["status"], line["cache"]) for line in lines] == [
        (200, "MISS"), (200, "HIT"), (200, "MISS")]
    assert lines[0]["key"] == lines[1]["key"] != lines[2]["key"]
    assert int(str(lines[0]["prefill_tokens"])) > 16384  # an agent's prompt, not a demo's
