"""A scratch git repository for the agent CLIs' tests (Codex, Claude Code): both run in a git
checkout, as their users do, and read its README into their context."""

from __future__ import annotations

import subprocess
from pathlib import Path

# A throwaway identity, given per command: the commit needs one and the machine may have none.
_GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]


def scratch_repo(path: Path, readme: str) -> Path:
    """`path`, created: a git repository whose one commit holds README.md with `readme`."""
    path.mkdir()
    (path / "README.md").write_text(readme)
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run([*_GIT, *args], cwd=path, check=True)
    return path
