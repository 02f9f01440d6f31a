"""labs/sync_vs_async.py: the synchronous loop (labs/sync_grpo.py) against the system's one-process run
(python train.py) at async ratio 0 and at 2, side by side: the same batch, model, task, learning rate and
seed, run one after the other on this machine; seconds per step and the reward, from each run's metrics
(train.py otherwise at its defaults: --redundant 4 admits 4 prompts more than a step needs).

    .venv/bin/python labs/sync_vs_async.py                    # 30 steps each: about 2-3 minutes on 2 cores
    .venv/bin/python labs/sync_vs_async.py --steps 10 --out-dir /tmp/sva

What the columns mean: s/step is the mean over the steps after the first (the first pays the engine's and
the trainer's warm-up). All three train on B groups whose rewards differ (dynamic sampling), so a step is
the same work. In one process a training step blocks the event loop, so even at ratio 2 rollout does not
run while the trainer trains: what asynchrony buys here is rollout running ahead between steps (the next
step's samples already started, the engine kept full rather than waiting for a step's slowest sample), not
the overlap with training that separate processes get (torchrun, bash run.sh). Measure on a quiet machine.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from config import opt, parse_cli  # noqa: E402


@dataclass
class CompareConfig:
    steps: int = opt(30, "training steps of each run")
    batch_groups: int = opt(32, "B, for every run")
    seed: int = opt(0, "seed, for every run")
    out_dir: str = opt("/tmp/sync_vs_async", "each run's metrics go under this folder")


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(name: str, rows: list[dict]) -> str:
    """One table row: seconds per step (and its rollout and train parts) after the first step, the reward's
    rise, the largest staleness trained."""
    steady = rows[1:] or rows
    k = min(10, len(rows))
    first, last = (sum(r["reward_mean"] for r in part) / k for part in (rows[:k], rows[-k:]))

    def mean(*keys):            # (sync_grpo.py's time_rollout is train.py's time_wait_rollout)
        return sum(next(r[key] for key in keys if key in r) for r in steady) / len(steady)
    return (f"| {name} | {mean('time_step'):.2f} | {mean('time_rollout', 'time_wait_rollout'):.2f} | "
            f"{mean('time_train'):.2f} | {first:.3f} -> {last:.3f} | "
            f"{max(r.get('staleness_max', 0) for r in rows)} |")


def main():
    cfg = parse_cli(CompareConfig, doc=__doc__)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(cfg.steps), "--batch-groups", str(cfg.batch_groups), "--seed", str(cfg.seed)]
    runs = [("labs/sync_grpo.py (one file, synchronous)", out / "sync.jsonl",
             [sys.executable, "labs/sync_grpo.py", *common, "--out", str(out / "sync.jsonl")])]
    for alpha in (0, 2):
        d = out / f"train_ratio{alpha}"
        runs.append((f"python train.py --async-ratio {alpha}", d / "metrics.jsonl",
                     [sys.executable, "train.py", *common, "--async-ratio", str(alpha), "--out-dir", str(d),
                      "--overwrite", "--save-every", "0"]))
    lines = ["| run | s/step | of it: rollout (wait) | train | reward, first 10 -> last 10 steps | "
             "staleness max |", "|---|---|---|---|---|---|"]
    for name, metrics, command in runs:
        print("running:", " ".join(command[1:]), flush=True)
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        lines.append(summary(name, rows_of(metrics)))
    print("\n".join(["", f"{cfg.steps} steps, B {cfg.batch_groups}, seed {cfg.seed}; command: python "
                     f"labs/sync_vs_async.py {' '.join(sys.argv[1:])}", *lines]))


if __name__ == "__main__":
    main()
