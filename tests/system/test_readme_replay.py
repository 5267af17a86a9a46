"""The README's pytest set-up for recorded answers runs as written: it records, replays,
and fails loudly on what was not recorded (pytest in a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
# The example's own pytest loads no plugin it does not use (this environment's hypothesis and
# langsmith plugins cost ~3 s of start-up per run; a user's project has its own set).
QUIET_PYTEST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_the_readme_pytest_example_records_then_replays(tmp_path: Path) -> None:
    text = README.read_text()
    example = text.split("<!-- replay-example -->")[1].split("<!-- /replay-example -->")[0]
    code = example.split("```python\n")[1].split("```")[0]
    conftest, tests = code.split("# test_answers.py\n")
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_answers.py").write_text(tests)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def pytest_run(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**env, **extra, **QUIET_PYTEST})

    recorded = pytest_run(RECORD="1")
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    assert (tmp_path / "llm.jsonl").read_text().count("\n") == 1
    # One replaying run (each starts pytest and a server): the recorded test passes as
    # written, a question that was not recorded fails loudly beside it.
    unrecorded = tests.replace("the fox eat", "the owl eat").replace("def test_the_fox",
                                                                      "def test_the_owl")
    (tmp_path / "test_answers.py").write_text(tests + "\n\n" + unrecorded)
    replayed = pytest_run()
    assert "1 failed, 1 passed" in replayed.stdout, replayed.stdout + replayed.stderr
    assert "FAILED test_answers.py::test_the_owl" in replayed.stdout, replayed.stdout
    assert "not_recorded" in replayed.stdout, replayed.stdout
