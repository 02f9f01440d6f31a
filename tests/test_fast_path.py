"""The whole default path once, in seconds, for the quick tier (`bash run.sh test fast`): `python train.py`
without torchrun (ext/one_process.py: the controller, an env manager and the trainer on one event loop, the
plain-torch engine) for 2 steps on a random-init tiny model (tiny_model.build_random: seconds to build), so a
change to any root module that breaks a run fails here, before the suite's real-engine and torchrun runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast
ROOT = Path(__file__).resolve().parent.parent


def test_two_steps_of_the_whole_system_on_a_random_model(tmp_path, random_model_dir):
    """Two steps (4 prompts x 4 samples, every group trained: a random model's rewards are all 0), every sync
    probed: each row trains a batch within the async ratio, the engine holds the trainer's weights after every
    sync, and the checkpoint is a model dir."""
    out = tmp_path / "run"
    args = ["--model", str(random_model_dir), "--steps", "2", "--batch-groups", "4", "--group-size", "4",
            "--max-tokens", "8", "--no-filter-groups", "--check-sync-every", "1", "--out-dir", str(out),
            "--max-events", "0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}      # (not torchrun's)
    r = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2] and all(x["num_samples"] == 16 for x in rows)
    assert all(x["staleness_max"] <= 2 for x in rows)
    assert rows[1]["sync_probe_max_diff"] is not None and rows[1]["sync_probe_max_diff"] < 1e-4
    assert (out / "checkpoint" / "config.json").exists() and "run done: 2 steps" in r.stdout
