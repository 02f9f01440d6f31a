"""What a user sees, on a real run (torchrun, 1 trainer + 1 rollout rank, the default layout, 3 small steps;
on the plain-torch engine, --engine torch: vLLM's own log lines are checked on tests/test_train.py's vLLM
runs, assert_quiet): no INFO lines or progress bars from the libraries, the step lines with an ETA, the
summary, and in out_dir the events tools/plot.py needs and tensorboard scalars equal to metrics.jsonl."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.jobs import free_port_pair
from test_train import assert_quiet, kill_tree

ROOT = Path(__file__).resolve().parent.parent


def test_default_run_output_and_records(tmp_path):
    out, log_path = tmp_path / "run", tmp_path / "run.log"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()),
           "train.py", "--rollout-gpus", "1", "--train-gpus", "1", "--engine", "torch",
           "--out-dir", str(out), "--steps", "3", "--batch-groups", "4", "--group-size", "4",
           "--redundant", "2", "--max-concurrency", "16", "--timeout-s", "180", "--tracker", "tensorboard"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}      # as run.sh sets it
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(420)
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            raise
    text = log_path.read_text()
    assert rc == 0, text[-3000:]

    # quiet: nothing at INFO level, no progress bars, no torchrun banner
    assert_quiet(text)
    lines = text.splitlines()
    # the progress: what start-up does, a line per step with an ETA, the summary
    assert "starting 1 engine and warming up" in text and "rollout ready: 1 engine in" in text
    steps = [x for x in lines if x.startswith("step ")]
    assert [x.split("|")[0].split()[1] for x in steps] == ["1/3", "2/3", "3/3"]
    assert all(re.search(r"\| eta \d", x) for x in steps)
    assert "run done: 3 steps in" in text and "(first 1 steps) ->" in text and "wait for rollout" in text
    assert f"python -m tools.plot {out}" in text
    assert len(lines) < 30, text                     # the whole output, start to summary

    # events.jsonl: the trainer's steps, each sync's phases on the rank, the engine's requests
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    kinds = [e["ev"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and "ready" in kinds
    assert [e["version"] for e in events if e["ev"] == "step"] == [1, 2, 3]
    phases = {(e["name"], e["version"]) for e in events if e["ev"] == "phase"}
    for v in (1, 2, 3):
        # (a suspend carries the version it leaves; load, the broadcast into the engine, the one it brings)
        assert {("suspend", v - 1), ("load", v), ("resume", v)} <= phases
    reqs = [e for e in events if e["ev"] == "req"]
    assert len(reqs) >= 3 * 16 and {e["rank"] for e in reqs} == {0}
    assert all(0 <= e["v"][0] <= e["v"][1] <= 3 and e["t"][0] <= e["t"][1] for e in reqs)

    # tensorboard: the scalars of metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for key in ("reward_mean", "time_step", "staleness_max", "loss"):
        assert [(e.step, e.value) for e in acc.Scalars(key)] == \
            [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows], key

    # and tools/plot.py draws it
    r = subprocess.run([sys.executable, "-m", "tools.plot", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "timeline.png").stat().st_size > 10_000
