"""tail_learning.py: does tail batching change what the model learns? (issue 32, item 5)

    .venv/bin/python -m tools.tail_learning                     # 3 seeds x {off, on}, ~15 min here
    .venv/bin/python -m tools.tail_learning --seeds 0 --steps 20          # a quick look

The default task (addition, the tiny model) at --async-ratio 0, each seed with and without
--tail-batching, held-out evaluation every --eval-every versions (greedy and mean@4 over 64
problems). Tail batching trains every prompt it admits, but the long ones a few steps later, in long
rounds: the question is whether that changes the final eval by more than the seeds' spread.

Writes results/tail_learning.md (final eval per run, mean and spread per setting) and
results/tail_learning.png (the eval curves, one line per run; --results-dir: elsewhere). The runs go to
runs/tail_learning/.
"""

import argparse
import statistics
import time
from pathlib import Path

from tools.jobs import run_to_end, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"off": (), "tail batching": ("--tail-batching",)}


def run(args, seed: int, flags: tuple, out: Path) -> list[dict]:
    cmd = torchrun_cmd("--steps", str(args.steps), "--async-ratio", "0", "--eval-every", str(args.eval_every),
                       "--save-every", "0", "--seed", str(seed), "--out-dir", str(out), "--overwrite", *flags)
    rows = run_to_end(cmd, out, "tail_learning", args.timeout_s)
    return [r for r in rows if r.get("eval_greedy") is not None]


def main(args):
    root = Path(args.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    curves = {}                                     # (setting, seed) -> eval rows
    for seed in args.seeds:
        for name, flags in SETTINGS.items():
            out = root / f"{name.replace(' ', '_')}-seed{seed}"
            curves[name, seed] = run(args, seed, flags, out)
            last = curves[name, seed][-1]
            print(f"tail_learning: seed {seed} {name}: final eval greedy {last['eval_greedy']:.3f} "
                  f"mean@4 {last['eval_mean_at_4']:.3f} (version {last['eval_version']})", flush=True)
    minutes = (time.monotonic() - t0) / 60
    lines = ["# tail batching and learning (the default task, async ratio 0)", "",
             f"`python -m tools.tail_learning --seeds {' '.join(map(str, args.seeds))} --steps {args.steps} "
             f"--eval-every {args.eval_every}` ({minutes:.0f} min); final held-out eval (64 problems, greedy "
             "and mean@4 at temperature 1) after the last step", "",
             "| setting | seed | greedy | mean@4 |", "|---|---|---|---|"]
    for (name, seed), rows in curves.items():
        last = rows[-1]
        lines.append(f"| {name} | {seed} | {last['eval_greedy']:.3f} | {last['eval_mean_at_4']:.3f} |")
    lines += ["", "| setting | greedy mean | greedy spread (max - min) | mean@4 mean | mean@4 spread |",
              "|---|---|---|---|---|"]
    for name in SETTINGS:
        g = [curves[name, s][-1]["eval_greedy"] for s in args.seeds]
        m = [curves[name, s][-1]["eval_mean_at_4"] for s in args.seeds]
        lines.append(f"| {name} | {statistics.fmean(g):.3f} | {max(g) - min(g):.3f} | "
                     f"{statistics.fmean(m):.3f} | {max(m) - min(m):.3f} |")
    print("\n".join(lines), flush=True)
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "tail_learning.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, seed), rows in curves.items():
        ax.plot([r["eval_version"] for r in rows], [r["eval_mean_at_4"] for r in rows],
                color="tab:blue" if name == "off" else "tab:orange", alpha=0.8,
                label=name if seed == args.seeds[0] else None)
    ax.set_xlabel("version (training steps)")
    ax.set_ylabel("held-out mean@4")
    ax.set_title(f"tail batching at async ratio 0, {len(args.seeds)} seed(s) each", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(results / "tail_learning.png", dpi=120)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out-dir", default="runs/tail_learning")
    ap.add_argument("--results-dir", default=str(ROOT / "results"), help="where tail_learning.md and .png go")
    ap.add_argument("--timeout-s", type=float, default=1200, help="per run")
    main(ap.parse_args())
