"""tools/study.py (the off-policy study), run for real with tiny settings: one engine, two short runs and a
freshest-first run, the files it writes, and the figures each run must carry."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent


def test_study_runs_and_writes_its_table_and_plot(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.study", "--losses", "decoupled_ppo", "--ratios", "0,2",
                        "--seeds", "0", "--steps", "3", "--batch-groups", "4", "--group-size", "4",
                        "--redundant", "2", "--eval-prompts", "8", "--eval-k", "2",
                        "--out-dir", str(tmp_path), "--trace", str(tmp_path / "trace.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    data = json.loads((tmp_path / "study.json").read_text())
    runs = data["runs"]
    assert [(x["loss"], x["async_ratio"], x["sample_order"]) for x in runs] == [
        ("decoupled_ppo", 0, "oldest"), ("decoupled_ppo", 2, "oldest"), ("ppo", 2, "freshest")]
    for x in runs:
        assert x["samples"] == 3 * 4 * 4                        # the same number of samples in every run
        assert 0 <= x["eval_mean_at_k"] <= 1 and 0 <= x["eval_greedy"] <= 1
        assert x["staleness_max"] <= x["async_ratio"]
    assert runs[0]["staleness_max"] == 0 and 0 <= data["initial"] <= 1
    assert "| decoupled_ppo | 2 | oldest | 1 |" in (tmp_path / "study.md").read_text()
    assert (tmp_path / "study.png").stat().st_size > 10_000
    trace = json.loads((tmp_path / "trace.json").read_text())          # --trace: every run's steps
    assert [len(t["steps"]) for t in trace] == [3, 3, 3] and trace[1]["async_ratio"] == 2
    assert all(s["tasks_queued"] >= 0 and s["staleness_mean"] <= t["async_ratio"]
               for t in trace for s in t["steps"])
