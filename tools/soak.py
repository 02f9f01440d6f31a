"""soak.py: a long run with faults injected, watched for leaks.

    .venv/bin/python -m tools.soak                  # 30 minutes, async ratio 2, 10% env failures, 5% hangs
    .venv/bin/python -m tools.soak --minutes 3 -- --batch-groups 8      # extra args after -- go to train.py
    .venv/bin/python -m tools.soak --engine-rounds 8     # one engine alone: its memory over 8 x 10k requests

The job is the default layout (`torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1`)
at --async-ratio 2 with --env-fail-rate 0.1 --env-hang-rate 0.05 (a hung env call fails after
--env-step-timeout-s 2) and --time-limit-min MINUTES, so it ends on its own and writes its final
counters. Every --every-s seconds this records, for every process of the job (torchrun, the trainer
rank, its queue server, the rollout rank, vLLM's engine core and worker, the verifier pool if any):
resident memory (RSS), open file descriptors and threads.

Printed at the end, one JSON object:
- per process: RSS after warm-up (the first sample past --warmup-min) and at the end, the growth, and
  the least-squares slope over the same window in MB per 10 minutes; fds and threads, first and last;
- steps, and whether every step held the staleness bound (staleness_max <= async ratio);
- leaks at the end (rollout_stats.json, written after the controller's STOP): requests still in the
  engine, trajectories still holding a slot, groups admitted but never resolved beyond the admission
  bound ((ratio + 1) x batch + redundant), and the failures counted on both sides.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tools.jobs import job_tree, split_args, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent   # the repository root


def sample(root_pid: int) -> dict:
    """role -> (rss MB, fds, threads), summed over the job's processes of the same role."""
    import psutil
    out: dict[str, list[float]] = {}
    for role, p in job_tree(root_pid).values():
        try:
            rss, fds, threads = p.memory_info().rss / 2**20, p.num_fds(), p.num_threads()
        except psutil.NoSuchProcess:
            continue
        acc = out.setdefault(role, [0.0, 0, 0])
        acc[0], acc[1], acc[2] = acc[0] + rss, acc[1] + fds, acc[2] + threads
    return out


def slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope dy/dt."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def engine_rounds(args):
    """One vLLM engine in this process, rounds of 10,000 short requests (500 at a time): the engine
    core's and worker's RSS after each round, to tell a leak from a warm-up that levels off."""
    import asyncio

    import psutil

    from ext.quiet import quiet
    quiet()
    import tiny_model
    from proxy import LLMProxy, Sampling

    async def run():
        proxy = await LLMProxy.start_vllm(str(tiny_model.ensure_tiny_model()), rank=0, max_num_seqs=64)

        def rss():
            kids = psutil.Process().children(recursive=True)
            return {role: round(sum(p.memory_info().rss for p in kids
                                    if key in " ".join(p.cmdline())) / 2**20, 1)
                    for role, key in (("engine core", "EngineCore"), ("engine worker", "Worker"))}
        try:
            await proxy.generate([5, 6, 7], Sampling(max_tokens=2))
            print(f"  start: {rss()}", flush=True)
            for r in range(args.engine_rounds):
                for _ in range(20):
                    await asyncio.gather(*[proxy.generate([5, 6, 7, i % 20 + 2], Sampling(max_tokens=8))
                                           for i in range(500)])
                print(f"  after {10_000 * (r + 1)} requests: {rss()}", flush=True)
        finally:
            proxy.shutdown()
    asyncio.run(run())


def main(args):
    out = Path(args.out_dir)
    ratio = args.async_ratio
    cmd = torchrun_cmd("--steps", "1000000", "--time-limit-min", str(args.minutes),
                       "--async-ratio", str(ratio),
                       "--env-fail-rate", "0.1", "--env-hang-rate", "0.05", "--env-step-timeout-s", "2",
                       "--save-every", "100", "--out-dir", str(out), "--overwrite", *args.train_args)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    series: list[tuple[float, dict]] = []
    with open(out.with_suffix(".log"), "w") as log:
        job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while job.poll() is None:
                series.append((time.monotonic() - t0, sample(job.pid)))
                print(f"  {series[-1][0] / 60:5.1f} min: " + ", ".join(
                    f"{role} {v[0]:.0f} MB" for role, v in sorted(series[-1][1].items())), flush=True)
                deadline = time.monotonic() + args.every_s
                while job.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.5)
            rc = job.wait()
        finally:
            if job.poll() is None:
                job.kill()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stats = (json.loads((out / "rollout_stats.json").read_text())
             if (out / "rollout_stats.json").exists() else {})
    warm = [(t, s) for t, s in series if t >= args.warmup_min * 60 and s]
    memory = {}
    for role in sorted({r for _, s in warm for r in s}):
        pts = [(t, s[role]) for t, s in warm if role in s]
        first, last = pts[0][1], pts[-1][1]
        memory[role] = {"rss_mb_first": round(first[0], 1), "rss_mb_last": round(last[0], 1),
                        "rss_growth_mb": round(last[0] - first[0], 1),
                        "rss_growth_pct": (round(100 * (last[0] - first[0]) / first[0], 1)
                                           if first[0] else None),
                        "rss_slope_mb_per_10min": round(600 * slope([t for t, _ in pts],
                                                                     [v[0] for _, v in pts]), 2),
                        "fds": [first[1], last[1]], "threads": [first[2], last[2]],
                        "window_min": [round(pts[0][0] / 60, 1), round(pts[-1][0] / 60, 1)]}
    ctrl = stats.get("controller", {})
    # what the run was given: train.Config as a dict, the controller's flags under "controller"
    run = json.loads((out / "checkpoint" / "state.json").read_text())["config"]["controller"]
    bound = (ratio + 1) * run["batch_groups"] + run["redundant"]
    unresolved = ctrl.get("groups_admitted", 0) - ctrl.get("groups_taken", 0) \
        - ctrl.get("groups_filtered", 0) - ctrl.get("groups_dropped_stale", 0) - ctrl.get("groups_failed", 0)
    ranks = stats.get("rollout_ranks", [])
    print(json.dumps({
        "command": " ".join(cmd[1:]), "exit_status": rc, "wall_min": round((time.monotonic() - t0) / 60, 1),
        "steps": len(rows), "staleness_bound_held_every_step": all(r["staleness_max"] <= ratio for r in rows),
        "staleness_max": max((r["staleness_max"] for r in rows), default=None),
        "samples_failed": sum(r["samples_failed"] for r in rows),
        "env_timeouts": sum(r.get("env_timeouts", 0) for r in ranks),
        "failures_counted_both_sides": ctrl.get("failed_samples_received") == sum(r.get("samples_failed", 0)
                                                                                for r in ranks),
        "at_end": {"engine_requests_in_flight": [r.get("engine_in_flight") for r in ranks],
                   "env_manager_slots_in_use": [r.get("in_flight") for r in ranks],
                   "groups_unresolved": unresolved, "admission_bound": bound},
        "memory": memory,
    }, indent=2))


if __name__ == "__main__":
    argv, extra = split_args(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="training time (train.py --time-limit-min)")
    ap.add_argument("--async-ratio", type=int, default=2)
    ap.add_argument("--every-s", type=float, default=30.0, help="seconds between memory samples")
    ap.add_argument("--warmup-min", type=float, default=3.0, help="memory growth is measured from here")
    ap.add_argument("--out-dir", default="runs/soak")
    ap.add_argument("--engine-rounds", type=int, default=0,
                    help="instead: one engine alone, this many rounds of 10k requests")
    args = ap.parse_args(argv)
    args.train_args = extra
    engine_rounds(args) if args.engine_rounds else main(args)
