"""profile_step.py: where a default step's time goes, in every process of the job (py-spy).

    .venv/bin/python -m tools.profile_step                # the default run, profiled for 20 s after 15 steps
    .venv/bin/python -m tools.profile_step --seconds 30 -- --async-ratio 0     # extra args go to train.py

It starts the default run (`torchrun train.py`, the default layout), waits until `--skip` steps
are done (start-up and warm-up are not a step), then samples every process of the job with py-spy
(`record --subprocesses --nonblocking`, `--rate` Hz, `--seconds` s) and stops the run. Each process's
real CPU time over the same window comes from the OS (psutil); py-spy's samples split it into phases:
a sample is classified by process (trainer rank 0, its queue server, the rollout rank, vLLM's
engine core and worker) and by phase, from its stack (the first rule of PHASES that matches, in
order). py-spy alone cannot give CPU time: it counts a thread that is runnable but waiting for a
core (e.g. vLLM's spin-waits) the same as one running. Printed: for each process, its CPU time as a
share of wall time (100% = one core for the whole window), split over its phases, the core it is
pinned to, and the mean step time of the profiled window from metrics.jsonl.

py-spy samples without stopping the processes (--nonblocking), but it needs CPU itself: on 2
cores expect the profiled steps to run a little slower than unprofiled ones.
"""

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.jobs import job_tree, split_args, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent   # the repository root

# (process, phase, regex over the stack): first match wins. Process names: see process_of().
PHASES = [
    ("trainer", "train step: forward, backward, optimizer", r"train_step"),
    ("trainer", "full weights (state_dict gather)", r"full_state"),
    ("trainer", "probe logprobs", r"probe_logprobs"),
    ("trainer", "weight broadcast (gloo)", r"send_weights|weight_sync\.py"),   # (after the gather's frames)
    ("trainer", "checkpoint", r"save_checkpoint"),
    ("trainer", "advantages", r"group_advantages"),
    ("trainer", "controller: collect, admit, queue calls", r"collect|admit|get_many|put_many|get_sample"),
    ("trainer", "controller: sync protocol", r"sync_weights|finish_sync|_wait_acks"),
    ("trainer", "other (event loop, logging)", r""),
    ("queue server", "serving queue calls", r""),
    ("rollout rank", "receive weights (gloo)", r"receive_weights"),
    ("rollout rank", "suspend, load, resume", r"update_weights|load_weights|suspend|resume"),
    ("rollout rank", "vLLM front end: engine outputs",
     r"process_outputs_socket|OutputProcessor|output_handler"),
    ("rollout rank", "reward (verifier)", r"reward"),
    ("rollout rank", "trajectories + proxy",
     r"rollout_once|run_trajectory|LLMProxy|_consume|VLLMEngine.stream"),
    ("rollout rank", "env manager: slots, queue calls",
     r"_pull_tasks|_flush|exchange|get_many|put_many|_loop"),
    ("rollout rank", "other (event loop)", r""),
    ("vLLM engine core", "spin-wait on the worker queue", r"sched_yield|acquire_read|SpinCondition"),
    ("vLLM engine core", "scheduler", r"schedule|update_from_output"),
    ("vLLM engine core", "sending outputs", r"Socket\.send|send_multipart|process_output"),
    ("vLLM engine core", "other", r""),
    ("vLLM worker", "spin-wait on the engine queue", r"sched_yield|acquire_read|SpinCondition|dequeue"),
    ("vLLM worker", "model forward + sampling", r"execute_model|forward|sample"),
    ("vLLM worker", "other", r""),
]


def process_of(stacks: list[str], cmdline: str) -> str:
    """Name a process from its command line and all the stacks sampled in it."""
    if "VLLM::EngineCore" in cmdline:
        return "vLLM engine core"
    if "VLLM::Worker" in cmdline:
        return "vLLM worker"
    text = "\n".join(stacks)
    for name, rx in (("trainer", r"run_trainer"), ("rollout rank", r"run_rollout"),
                     ("queue server", r"serve_forever|serve_client|multiprocessing/managers"),
                     ("torchrun agent", r"elastic|torchrun")):
        if re.search(rx, text):
            return name
    return "other"


def cpu_s(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


def classify(raw: str) -> tuple[collections.Counter, dict]:
    """py-spy raw (collapsed) lines -> (Counter of (process, phase) -> samples, process -> pids)."""
    by_pid = collections.defaultdict(list)          # pid -> [(cmdline, stack, samples)]
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        if not procs:
            continue
        pid = int(re.match(r"process (\d+)", procs[-1]).group(1))
        by_pid[pid].append((procs[-1], ";".join(f for f in frames if not f.startswith("process ")), int(n)))
    out, pids = collections.Counter(), collections.defaultdict(set)
    for pid, samples in by_pid.items():
        proc = process_of([st for _, st, _ in samples], samples[0][0])
        pids[proc].add(pid)
        for _, stack, n in samples:
            phase = next((ph for p, ph, rx in PHASES if p == proc and re.search(rx, stack)), "other")
            out[proc, phase] += n
    return out, pids


def py_spy() -> Path:
    """The venv's py-spy (not in requirements.txt: `pip install py-spy`); checked before the run starts."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        raise SystemExit(f"profile_step: no py-spy at {spy}: install it (.venv/bin/pip install py-spy)")
    return spy


def main(args, train_args: list[str]):
    spy_bin = py_spy()
    out_dir = Path(tempfile.mkdtemp(prefix="profile-"))
    cmd = torchrun_cmd("--out-dir", str(out_dir), "--save-every", "0", "--steps", str(args.skip + 1000),
                       *train_args)
    log = open(out_dir / "train.log", "w")
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = out_dir / "metrics.jsonl"
    try:
        deadline = time.monotonic() + args.timeout_s
        while not metrics.exists() or len(metrics.read_text().splitlines()) < args.skip:
            if job.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"profile_step: the run ended or stalled before step {args.skip}; "
                                 f"see {out_dir / 'train.log'}")
            time.sleep(0.5)
        first = len(metrics.read_text().splitlines())
        procs = [p for _, p in job_tree(job.pid).values()]
        cpu0 = {p.pid: cpu_s(p) for p in procs}
        t0 = time.monotonic()
        raw = out_dir / "profile.raw"
        spy = [str(spy_bin), "record", "--pid", str(job.pid), "--subprocesses",
               "--nonblocking", "--rate", str(args.rate), "--duration", str(args.seconds), "--format", "raw",
               "--output", str(raw)]
        subprocess.run(spy, check=True, capture_output=True)
        wall = time.monotonic() - t0
        cpu = {p.pid: (cpu_s(p) - cpu0[p.pid], p.cpu_affinity()) for p in procs if p.is_running()}
        rows = [json.loads(x) for x in metrics.read_text().splitlines()][first:]
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(60)
        log.close()
    report(raw.read_text(), cpu, wall, rows, args.rate, train_args)


def report(raw: str, cpu: dict, wall: float, rows: list[dict], rate: int, train_args: list[str]):
    """Print the table: py-spy's raw samples split each process's CPU time (cpu: pid -> (seconds over
    the window, its cores)) over its phases; rows: metrics.jsonl's rows of the window."""
    counts, pids = classify(raw)
    steps = [r["time_step"] for r in rows]
    print(f"profile of {len(rows)} steps ({wall:.0f} s, py-spy at {rate} Hz; mean step "
          f"{sum(steps) / max(len(steps), 1):.3f} s; train.py {' '.join(train_args) or '(defaults)'})")
    print("| process (core) | phase | CPU, % of wall time |\n|---|---|---|")
    for proc in sorted({p for p, _ in counts}, key=lambda p: -sum(cpu.get(pid, (0,))[0] for pid in pids[p])):
        used = sum(cpu[pid][0] for pid in pids[proc] if pid in cpu)
        cores = sorted({c for pid in pids[proc] if pid in cpu for c in cpu[pid][1]})
        samples = sum(n for (p, _), n in counts.items() if p == proc)
        print(f"| **{proc}** ({','.join(map(str, cores))}) | **all** | **{100 * used / wall:.1f}%** |")
        for (p, phase), n in sorted(counts.items(), key=lambda kv: -kv[1]):
            share = used * n / samples / wall
            if p == proc and share >= 0.005:
                print(f"| {proc} | {phase} | {100 * share:.1f}% |")


if __name__ == "__main__":
    argv, extra = split_args(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", type=int, default=15, help="steps to let pass before profiling")
    ap.add_argument("--seconds", type=int, default=20, help="profiling window, seconds")
    ap.add_argument("--rate", type=int, default=50, help="samples per second per thread")
    ap.add_argument("--timeout-s", type=float, default=600, help="give up if --skip steps take longer")
    main(ap.parse_args(argv), extra)
