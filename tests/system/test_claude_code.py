"""Claude Code against the proxy (#32), driven as its users drive it: `claude -p` in a scratch
git repository with ANTHROPIC_BASE_URL at the proxy, an API key, non-essential traffic off.

Its prompt is ~31k tokens of the demo tokenizer, so the proxy serves the agent model
(`cacheproxy agent-model`, 65,536 positions) under OpenBLAS, where that prefill takes
seconds. The run completes without a protocol error; a second identical run is answered
from the cache: each of its model requests is a HIT on the key its twin in the first run
MISSed (the first run's MISSes are the control: the same check fails on a cold cache).
Skipped only when the npm package is not installed (`.ci/run` installs it), as Codex's test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cacheproxy.runners.demo.agent import write_agent
from tests.harness.processes import openblas_env, serving
from tests.harness.repos import scratch_repo

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"  # what .ci/run installs
MODEL = "cacheproxy-agent"
KEY = "sk-local-test"
TASK = "Add a line saying hello to README.md"


def _claude() -> str:
    """The `claude` command: on PATH (.ci/run installs it globally) or beside this Python."""
    found = shutil.which("claude", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found:
        return found
    pytest.skip(f"the npm package {CLAUDE_CODE} is not installed (`npm install -g "
                f"{CLAUDE_CODE}`, as .ci/run does; .ci/run says when npm could not install it)")


def _run(claude: str, url: str, repo: Path, home: Path) -> list[dict[str, Any]]:
    """One `claude -p` run: its stream-json events (stdout)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}
    done = subprocess.run(
        [claude, "-p", TASK, "--model", MODEL, "--output-format", "stream-json", "--verbose"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _answers(events: list[dict[str, Any]]) -> list[Any]:
    """The content of each assistant message Claude Code received, and how the run ended."""
    result = next(e for e in events if e["type"] == "result")
    assert result["subtype"] == "success" and not result["is_error"], result
    return [e["message"]["content"] for e in events if e["type"] == "assistant"]


def _model_requests(log: str) -> list[tuple[int, str, str]]:
    """(status, cache, key) of each POST /v1/messages in the proxy's JSON access log."""
    lines = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return [(e["status"], e.get("cache", ""), e.get("key", "")) for e in lines
            if e.get("event") == "request" and e.get("path") == "/v1/messages"]


def test_claude_code_runs_against_the_proxy_and_its_repeat_is_served_from_the_cache(
        tmp_path: Path) -> None:
    claude = _claude()
    model = write_agent(tmp_path / "agent", context=65536)
    repo, home = scratch_repo(tmp_path / "repo", "# scratch\n"), tmp_path / "home"
    home.mkdir()
    output: list[str] = []
    with serving("--model", str(model), "--model-id", MODEL, "--store", "memory://",
                 "--no-watch", "--api-key", KEY, "--log-format", "json",
                 env=openblas_env(), output=output) as url:
        first = _answers(_run(claude, url, repo, home))
        second = _answers(_run(claude, url, repo, home))
    assert first and second == first
    requests = _model_requests(output[0])
    half = len(requests) // 2
    assert requests and len(requests) == 2 * half, requests
    assert all(status == 200 for status, _, _ in requests), requests
    assert [cache for _, cache, _ in requests] == ["MISS"] * half + ["HIT"] * half, requests
    assert [k for _, _, k in requests[:half]] == [k for _, _, k in requests[half:]]
