"""jobs.py: a train.py job as the tools see it from outside (soak.py, bench_chaos.py, profile_step.py,
bench_e2e.py and the torchrun tests): the command that launches it, a run to its end, its processes by
role, and the `-- extra args` that a tool passes on to train.py.

    cmd = torchrun_cmd("--steps", "10", "--out-dir", "runs/x")    # 1 trainer + 1 rollout rank, free ports
    rows = run_to_end(cmd, Path("runs/x"), "my_tool", timeout_s=600)   # metrics.jsonl's rows; log: runs/x.log
    roles = job_tree(job.pid)                                      # pid -> (role, psutil.Process)
    own, extra = split_args(sys.argv[1:])                          # tool.py --its-flags -- --train-flags
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent   # the repository root

ROLES = ("torchrun", "engine core", "engine worker", "trainer rank", "rollout rank", "queue server",
         "resource tracker", "helper")


def free_port_pair() -> int:
    """A port p with p and p + 1 free (torchrun's master port, and the buffer's queue server)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                    return p
                except OSError:
                    continue
    raise RuntimeError("no free port pair")


def torchrun_cmd(*train_args: str, rollout_gpus: int = 1, launcher=(), train_gpus: int = 1) -> list[str]:
    """`torchrun ... train.py` on one node: `train_gpus` trainer ranks + `rollout_gpus` rollout ranks (1 +
    1: the default layout), on free loopback ports; `launcher`: extra torchrun flags (e.g. --max-restarts)."""
    return [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(rollout_gpus + train_gpus),
            *launcher,
            "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()), "train.py",
            "--rollout-gpus", str(rollout_gpus), "--train-gpus", str(train_gpus), *train_args]


def run_to_end(cmd: list[str], out: Path, who: str, timeout_s: float, cwd: Path = ROOT,
               env: dict | None = None) -> list[dict]:
    """Run a train.py job (its --out-dir: out) to its end, its output in out.log; a failure exits naming
    the command and the log. Returns metrics.jsonl's rows, one per step."""
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                            env={**os.environ, **env} if env else None).returncode
    if rc != 0:
        raise SystemExit(f"{who}: {' '.join(cmd)}" + (f" in {cwd}" if cwd != ROOT else "")
                         + f" failed (exit {rc}); see {out.with_suffix('.log')}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def role_of(p, root_pid: int) -> str:
    """One of ROLES for a process of the job started as `root_pid` (torchrun)."""
    cmd = " ".join(p.cmdline())
    if p.pid == root_pid:
        return "torchrun"
    if "EngineCore" in cmd:
        return "engine core"
    if "VLLM::Worker" in cmd or "VllmWorker" in cmd:
        return "engine worker"
    if "train.py" in cmd and p.ppid() == root_pid:
        return "trainer rank" if p.environ().get("RANK") == "0" else "rollout rank"
    if "resource_tracker" in cmd:
        return "resource tracker"
    parent = p.parent()
    if (parent is not None and "train.py" in " ".join(parent.cmdline())
            and parent.environ().get("RANK") == "0"):
        return "queue server"
    return "helper"


def job_tree(pid: int) -> dict:
    """pid -> (role, psutil.Process) for torchrun and everything under it, right now ({} once it is gone)."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = (role_of(p, pid), p)
        except psutil.NoSuchProcess:
            continue
    return out


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """A tool's own arguments, and those after `--` (passed on to train.py)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]
