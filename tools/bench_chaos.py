"""bench_chaos.py: a run that heals itself. SIGKILL a random rank at a random time, again and again;
torchrun restarts the ranks and the run resumes from its last complete checkpoint on its own.

    .venv/bin/python -m tools.bench_chaos            # 10 kills, 60 steps, a checkpoint every 5 (~10 min)
    .venv/bin/python -m tools.bench_chaos --kills 3 --steps 20

The job: `torchrun --max-restarts K ... train.py --resume auto --save-every N` (the default layout).
While it runs, after each (re)start has trained at least one step, wait a random time (--min-wait-s
to --max-wait-s), then SIGKILL a random rank (trainer or rollout). Per kill it records the last
step in metrics.jsonl and the step of the checkpoint on disk at that moment: the work lost is the
steps between them, to be trained again (at most one checkpoint interval, --save-every). At the end:
the job's exit status, and whether metrics.jsonl holds every step exactly once. Prints one JSON object.
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools.jobs import job_tree, split_args, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent   # the repository root


def steps_done(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def checkpoint_step(out: Path) -> int:
    path = out / "checkpoint" / "state.json"
    try:
        return json.loads(path.read_text())["step"]
    except (OSError, ValueError):
        return 0


def main(args):
    out = Path(args.out_dir)
    cmd = torchrun_cmd("--steps", str(args.steps), "--save-every", str(args.save_every), "--resume", "auto",
                       "--out-dir", str(out), *args.train_args,
                       launcher=("--max-restarts", str(args.kills + 2)))
    # a fresh run (torchrun restarts it with the same argv: --resume auto finds its checkpoint)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    log = open(out.with_suffix(".log"), "w")
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    kills = []
    try:
        while len(kills) < args.kills and job.poll() is None:
            # wait until this (re)start trained a step, then a random time more
            seen = len(steps_done(out))
            while job.poll() is None and len(steps_done(out)) <= seen:
                time.sleep(0.2)
            time.sleep(rng.uniform(args.min_wait_s, args.max_wait_s))
            procs = [(role, p) for role, p in job_tree(job.pid).values()
                     if role in ("trainer rank", "rollout rank")]
            if job.poll() is not None or not procs:
                break
            role, victim = rng.choice(sorted(procs, key=lambda rp: rp[1].pid))
            done, ckpt = steps_done(out), checkpoint_step(out)
            victim.kill()
            kills.append({"t_s": round(time.monotonic() - t0, 1), "victim": role,
                          "last_step": max(done, default=0),
                          "checkpoint_step": ckpt, "steps_lost": max(done, default=0) - ckpt})
            print(f"kill {len(kills)}: {kills[-1]}", flush=True)
        rc = job.wait(args.timeout_s)
    finally:
        if job.poll() is None:
            job.kill()
    steps = steps_done(out)
    print(json.dumps({
        "command": " ".join(cmd[1:]), "exit_status": rc, "wall_s": round(time.monotonic() - t0, 1),
        "kills": kills, "max_steps_lost": max((k["steps_lost"] for k in kills), default=0),
        "save_every": args.save_every, "metrics_rows_consistent": steps == list(range(1, args.steps + 1)),
        "restarts_logged": out.with_suffix(".log").read_text().count("resuming at step"),
    }, indent=2))


if __name__ == "__main__":
    argv, extra = split_args(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--min-wait-s", type=float, default=0.0,
                    help="after a (re)start's first step, wait at least this")
    ap.add_argument("--max-wait-s", type=float, default=8.0,
                    help="... and at most this, before the next kill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="runs/chaos")
    ap.add_argument("--keep", action="store_true", help="do not clear out-dir first")
    ap.add_argument("--timeout-s", type=float, default=3600)
    args = ap.parse_args(argv)
    args.train_args = extra
    main(args)
