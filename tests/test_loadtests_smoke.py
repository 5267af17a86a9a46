"""Every load test's --smoke mode runs to the end and writes its table and plot (so none rots).

Each runs as its own subprocess, as a user would run it; they start their own servers on
127.0.0.1 and stop them. Needs matplotlib (the test extra) and wrk for hit_path (skipped
without it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LOADTESTS = Path(__file__).resolve().parents[1] / "loadtests"
SMOKES = {
    "reproducibility": ("reproducibility.png", "| t0 concurrent |"),
    "hit_path": ("hit_path.png", "| tiered |"),
    "workload": ("workload.png", "| through cacheproxy |"),
    "faults": ("faults.png", "| hostile |"),
    "coherence": ("coherence.png", "| tiered+redis, l1_ttl 3600 s | 5 |"),
}


@pytest.mark.parametrize("name", list(SMOKES))
def test_smoke(name: str, tmp_path: Path) -> None:
    if name == "hit_path" and shutil.which("wrk") is None:
        pytest.skip("wrk is not installed")
    plot, row = SMOKES[name]
    done = subprocess.run([sys.executable, str(LOADTESTS / f"{name}.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert row in done.stdout, done.stdout
    assert (tmp_path / plot).stat().st_size > 1000
    assert (tmp_path / f"{name}.json").exists()


def test_bench_structured_smoke(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(LOADTESTS / "bench_structured.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "| demo |" in done.stdout and "| llama-128x2 |" in done.stdout
    rows = json.loads((tmp_path / "bench_structured.json").read_text())
    assert all(r["constrained_ms_per_token"] > 0 and r["reuse_ms"] < r["compile_20_fields_ms"]
               for r in rows)
