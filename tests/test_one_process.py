"""python train.py without torchrun: the whole system in one process and one event loop (the controller, one
env manager, the trainer), on ext/torch_engine.py's plain-torch engine; it runs with vLLM made unimportable,
and a debugger stepping through it reaches rl_step."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# train.py as `python train.py` runs it, with vLLM unimportable first (an install without it)
NO_VLLM = ("import runpy, sys; sys.path.insert(0, '.'); sys.modules['vllm'] = None; "
           "sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')")


def run(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}, **kw)


def test_the_whole_system_runs_in_one_process_without_vllm(tmp_path, tiny_model_dir):
    """6 steps: the first line says which mode this is and how to launch the real system; every step trains
    a batch of the async ratio's staleness at most, and every sync's probe finds the engine holding the
    trainer's weights (the weights passed in process); a checkpoint is written."""
    from ext.one_process import ONE_PROCESS
    out = tmp_path / "one"
    r = run("-c", NO_VLLM, "--steps", "6", "--out-dir", str(out), "--batch-groups", "4", "--group-size", "4",
            "--check-sync-every", "1", "--save-every", "0")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.splitlines()[0] == ONE_PROCESS
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(1, 7)) and all(x["num_samples"] == 16 for x in rows)
    assert all(x["staleness_max"] <= 2 for x in rows)
    assert all(x["sync_probe_max_diff"] is not None and x["sync_probe_max_diff"] < 1e-4 for x in rows[1:])
    assert (out / "checkpoint" / "state.json").exists()


def test_a_debugger_stepping_through_the_run_reaches_rl_step(tmp_path, tiny_model_dir):
    """docs/tour.md's recipe: python -m pdb train.py --steps 2, then break at controller.rl_step."""
    commands = "import controller\nbreak controller.rl_step\ncontinue\np ctrl.version\nquit\n"
    r = run("-m", "pdb", "train.py", "--steps", "2", "--out-dir", str(tmp_path / "pdb"), input=commands)
    assert "controller.py" in r.stdout and "rl_step()" in r.stdout, r.stdout[-3000:]
    assert "\n(Pdb) 0\n" in r.stdout          # stopped in the first step: the controller at version 0


def test_one_process_runs_one_engine_and_one_trainer(tmp_path):
    r = run("train.py", "--rollout-gpus", "2", "--out-dir", str(tmp_path / "o"))
    assert r.returncode != 0 and "one engine and one trainer" in r.stderr and "torchrun" in r.stderr


def test_a_verifier_that_always_raises_stops_the_run_and_keeps_its_last_checkpoint(tmp_path, tiny_model_dir):
    """Two good steps, then the run resumed with a verifier that raises on every answer: it would retry and
    re-admit for ever; it stops instead (exit 1), naming the reason with its count and the flag, and the
    checkpoint and metrics of the good steps stay as they were."""
    out, common = tmp_path / "run", ["--batch-groups", "4", "--group-size", "4"]
    r = run("train.py", "--steps", "2", "--out-dir", str(out), *common)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in (out / "checkpoint").iterdir() if p.is_file()}
    r = run("train.py", "--steps", "4", "--out-dir", str(out), "--resume", *common,
            "--reward", "tests.reward_fixtures:always_raises", timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert ("64 of the last 64 samples failed (at least --max-failed-share 0.95 of them)" in r.stderr
            and "64 x rollout rank 0: env 'single-turn' step 0" in r.stderr
            and "the verifier tests.reward_fixtures:always_raises raised ValueError" in r.stderr), \
        r.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in (out / "checkpoint").iterdir() if p.is_file()} == before
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
