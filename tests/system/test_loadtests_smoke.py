"""Every load test's --smoke mode runs to the end and writes its table and plot (so none rots).

Each runs as its own subprocess, as a user would run it; they start their own servers on
127.0.0.1 and stop them. Needs matplotlib (the test extra) and wrk for hit_path (fails
without it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# One at a time (each starts three or four servers, some pinned to a core), beside the rest.
pytestmark = pytest.mark.xdist_group("loadtests")

LOADTESTS = Path(__file__).resolve().parents[2] / "loadtests"
# Each script's wiring (servers, table, plot, JSON) with its cheapest scenario: the full-size
# runs are the scripts' own; the faults each scenario injects are tested in the suite (see
# loadtests/README.md, "What the suite covers"). coherence runs without its untracked
# baseline (the same two replicas again, on another Redis user: two `serve` starts).
SMOKES = {
    "reproducibility": (("--prompts", "2", "--repeats", "2", "--max-tokens", "8",
                         "--configs", "t0.7 unseeded,t0 concurrent"),
                        "reproducibility.png", "| t0 concurrent |"),
    "hit_path": (("--smoke",), "hit_path.png", "| tiered | stream |"),
    "workload": (("--distinct", "30", "--rate", "10", "--duration", "1", "--bucket", "0.5",
                  "--decode-slots", "2"),
                 "workload.png", "| through cacheproxy (in-process, S = 2) |"),
    "faults": (("--smoke", "--only", "hostile,soak"), "faults.png", "| hostile |"),
    "coherence": (("--rounds", "2", "--baseline-rounds", "0"), "coherence.png",
                  "| tiered+redis, l1_ttl 3600 s | 2 |"),
    "bench_batching": (("--smoke",), "bench_batching.png", "| proxy S=4 | 4 |"),
    "bench_margins": (("--smoke",), "bench_margins.png", "| demo | 2 |"),
}


@pytest.mark.parametrize("name", list(SMOKES))
def test_smoke(name: str, tmp_path: Path) -> None:
    if name == "hit_path" and shutil.which("wrk") is None:
        pytest.fail("wrk is not installed (.ci/run installs it)")
    flags, plot, row = SMOKES[name]
    done = subprocess.run([sys.executable, str(LOADTESTS / f"{name}.py"), *flags, "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert row in done.stdout, done.stdout
    assert (tmp_path / plot).stat().st_size > 1000
    assert (tmp_path / f"{name}.json").exists()


def test_rolling_upgrade_smoke(tmp_path: Path) -> None:
    """Two `serve` processes of two engine versions on one Redis (#21): HITs side by side,
    neither namespace purged, the old one gone a grace period after its replica stopped."""
    done = subprocess.run([sys.executable, str(LOADTESTS / "rolling_upgrade.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    result = json.loads((tmp_path / "rolling_upgrade.json").read_text())
    assert result["ok"] and result["both_live"] and result["failures"] == 0
    assert result["gone_after_s"] >= 2.0 and result["new_not_hits"] == 0
    assert [row[0] for row in result["rows"]] == ["old", "new"]
    assert all(row[3] > 0 and row[4] == 0 and row[5] == 0 for row in result["rows"])


def test_bench_structured_smoke(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(LOADTESTS / "bench_structured.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "| demo |" in done.stdout and "| llama-128x2 |" in done.stdout
    rows = json.loads((tmp_path / "bench_structured.json").read_text())
    assert all(r["constrained_ms_per_token"] > 0 and r["reuse_ms"] < r["compile_20_fields_ms"]
               for r in rows)
    schema = json.loads((tmp_path / "schema_run.json").read_text())
    assert schema["valid"] == schema["prompts"] == 4


def test_bench_prefix_smoke(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(LOADTESTS / "bench_prefix.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    result = json.loads((tmp_path / "bench_prefix.json").read_text())
    turns = result["turns"]
    assert len(turns) == 3 and all(t["identical"] for t in turns)
    assert turns[0]["reused"] == 0 and all(t["reused"] > 0 for t in turns[1:])
    shared = result["shared"]  # two more users: the system prompt's chunks are not copied
    assert all(r > 0 for r in shared["reused"])
    assert 0 < shared["bytes_added"] < shared["separate_states_bytes"]


def test_cost_curves_smoke(tmp_path: Path) -> None:
    # One store (Redis: its server, the purge in another process): the disk store's rows are
    # the same code on another URL, and cost 12 s of CPU more.
    done = subprocess.run([sys.executable, str(LOADTESTS / "cost_curves.py"), "--smoke",
                           "--stores", "redis", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "| redis | 3k |" in done.stdout, done.stdout
    assert (tmp_path / "cost_curves.png").stat().st_size > 1000
    result = json.loads((tmp_path / "cost_curves.json").read_text())
    run = result["stores"]["redis"]
    assert [r["entries"] for r in run["rows"]] == [1000, 3000]
    assert all(r["get_us"]["p99"] > 0 and r["bytes_per_entry"] > 0 for r in run["rows"])
    assert run["purge"]["entries"] == 3000 and run["purge"]["seconds"] > 0
    assert run["purge"]["during_us"]["samples"] > 0 and run["purge"]["p99_ratio"] > 0
    assert run["purge"]["paused_us"]["samples"] > 0 and run["purge"]["p99_vs_paused"] > 0
    assert all(r["list_all_s"] > 0 and r["sample_list_ms"] > 0 for r in run["rows"])
    assert run["verify"]["entries"] == 5 and run["verify"]["verify_per_s"] > 0
