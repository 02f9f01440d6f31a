"""runlog.py: rank 0's record of a run (metrics.jsonl, trackers, events.jsonl) and what it prints.

    log = RunLog(cfg, start_step)                   # trainer rank 0 (train.py)
    ready = await log.starting(ctrl.wait_ready())   # says what start-up waits for, then "rollout ready"
    ctrl.events = log.events                        # the controller records steps, forwards ranks' events
    log.step(step, version, info, train, sync, time_train, time_step)  # row, tracker, progress line
    log.finish()                                    # the summary at the end

Files in out_dir: metrics.jsonl (a row per step), events.jsonl (for tools/plot.py; format:
timeline.py), tensorboard/. Trackers (--tracker) get every numeric key of a row, on rank 0 only;
check_tracker() names a missing optional package before any process starts.

A weight sync overlaps the next step, so its numbers (synced_version, sync_probe_max_diff,
rollout_utilisation, time_receive, time_engine_load, time_vllm_load) land in the next row;
time_weight_sync is what the trainer itself spent on this step's sync.

Design notes: DESIGN.md#runlogpy
"""

import asyncio
import collections
import dataclasses
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from timeline import EventLog

# --tracker NAME -> the package it needs (None: nothing to install)
TRACKERS = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def print0(*args):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, flush=True)


def fmt_s(s: float) -> str:
    """Seconds for people: 42.0s, 3m05s, 1h02m."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def process_start() -> float:
    """When this process started (time.time() seconds): wall time counts from there."""
    try:
        import psutil    # installed with vLLM
        return psutil.Process().create_time()
    except ImportError:
        return time.time()


# ---------------------------------------------------------------------------------------------
# trackers


def check_tracker(name: str):
    """Raise ValueError naming the package to install when --tracker NAME cannot work here."""
    if name not in TRACKERS:
        raise ValueError(f"--tracker must be one of {', '.join(TRACKERS)}, got {name!r}")
    package = TRACKERS[name]
    if package and importlib.util.find_spec(package) is None:
        raise ValueError(f"--tracker {name} needs the optional package {package!r}, which is not installed: "
                         f"pip install {package}   (or use --tracker none; metrics.jsonl is always written)")


class NoTracker:
    def log(self, metrics: dict, step: int):
        pass

    def close(self):
        pass


class TensorBoardTracker:
    """Scalars in out_dir/tensorboard (tensorboard --logdir OUT_DIR/tensorboard)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter    # needs the tensorboard package
        self.writer = SummaryWriter(str(log_dir))

    def log(self, metrics: dict, step: int):
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()              # visible to a running tensorboard at once

    def close(self):
        self.writer.close()


class WandbLikeTracker:
    """wandb, or trackio (which copies wandb's init / log / finish)."""

    def __init__(self, module_name: str, project: str, name: str, config: dict, out_dir: Path):
        self.module_name = module_name
        self.mod = __import__(module_name)
        kwargs = {"dir": str(out_dir)} if module_name == "wandb" else {}
        self.mod.init(project=project, name=name, config=config, **kwargs)

    def log(self, metrics: dict, step: int):
        if self.module_name == "wandb":
            self.mod.log(metrics, step=step)
        else:
            self.mod.log(metrics)        # trackio counts one step per call; the row's "step" key is there too

    def close(self):
        self.mod.finish()


def make_tracker(cfg, fresh: bool):
    """The tracker --tracker asks for (rank 0 only). fresh: a new run, so old tensorboard files go."""
    check_tracker(cfg.tracker)
    out = Path(cfg.out_dir)
    if cfg.tracker == "tensorboard":
        if fresh:
            shutil.rmtree(out / "tensorboard", ignore_errors=True)
        return TensorBoardTracker(out / "tensorboard")
    if cfg.tracker in ("wandb", "trackio"):
        return WandbLikeTracker(cfg.tracker, cfg.tracker_project, out.name, dataclasses.asdict(cfg), out)
    return NoTracker()


def scalars(row: dict) -> dict:
    """The numeric keys of a metrics row (what trackers get)."""
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# ---------------------------------------------------------------------------------------------
# the run log


SUMMED = ("time_wait_rollout", "time_train", "time_weight_sync", "samples_dropped_stale", "groups_filtered",
          "samples_failed", "prompts_deferred", "tokens_aborted", "tokens_generated", "time_trainer_busy",
          "time_step")      # the row keys the summary adds up


class RunLog:
    def __init__(self, cfg, start_step: int = 0):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.path = self.out / "metrics.jsonl"
        self.start_step = start_step
        # this session's rows, bounded (a long run must not grow): the first and the last 10, sums
        self.num_rows = 0
        self.first: list[dict] = []
        self.recent: collections.deque[dict] = collections.deque(maxlen=10)
        self.totals: collections.Counter = collections.Counter()
        self.evals: dict[str, list[tuple[int, float]]] = {}    # eval key -> [(step, value) first, last]
        self.t_start = process_start()
        self.t_ready: float | None = None
        fresh = start_step == 0
        self.events = (EventLog(self.out / "events.jsonl", cfg.max_events, fresh) if cfg.max_events > 0
                       else None)
        if self.events is None and fresh:     # --max-events 0: no timeline, not an old run's either
            (self.out / "events.jsonl").unlink(missing_ok=True)
        if self.events is not None:
            self.events.add({"ev": "start", "t": self.t_start, "rollout_ranks": cfg.rollout_gpus,
                             "async_ratio": cfg.controller.async_ratio, "step": start_step,
                             "steps": cfg.steps})
        self.tracker = make_tracker(cfg, fresh)

    async def starting(self, awaitable) -> dict:
        """Await the engines' READY (controller.wait_ready, bounded by its own timeout), saying what
        start-up waits for, again every 15 s; then the "rollout ready" line."""
        n = self.cfg.rollout_gpus
        print0(f"starting {n} vLLM engine{'s' if n > 1 else ''} and warming up "
               f"(about 30 s on a 2-core CPU) ...")
        task = asyncio.ensure_future(awaitable)
        while not (await asyncio.wait({task}, timeout=15.0))[0]:
            print0(f"  ... still starting: {time.time() - self.t_start:.0f}s since launch")
        ready = task.result()
        self.t_ready = time.time()
        if self.events is not None:
            self.events.add({"ev": "ready", "t": self.t_ready})
        diff = ready.get("sync_probe_max_diff")
        print0(f"rollout ready: {n} engine{'s' if n > 1 else ''} in "
               f"{self.t_ready - self.t_start:.1f}s since launch"
               + (f", {probe_verdict(diff, self.cfg)}" if diff is not None else ""))
        return ready

    def step(self, step: int, version: int, info: dict, train: dict, sync: dict, time_train: float,
             time_step: float) -> dict:
        row = {"step": step, "version": version, **info, **train, "time_train": time_train,
               **{k: v for k, v in sync.items() if k != "acks"},
               "time_step": time_step, "samples_per_s": info["num_samples"] / time_step,
               "tokens_per_s": info["num_tokens"] / time_step}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.num_rows += 1
        if len(self.first) < 10:
            self.first.append(row)
        self.recent.append(row)
        self.totals.update({k: row.get(k) or 0 for k in SUMMED})
        self.totals["long_rounds"] += row.get("round") == "long"
        for k, v in row.items():
            if k.startswith("eval_") and v is not None:
                self.evals[k] = [self.evals.get(k, [(step, v)])[0], (step, v)]
        self.tracker.log(scalars(row), step)
        if self.events is not None:
            self.events.flush()
        print0(self.line(row))
        return row

    def eta(self, step: int) -> float:
        """Seconds left: the mean of the last 10 step times, times the steps left (or the time left
        under --time-limit-min, if less)."""
        recent = [r["time_step"] for r in self.recent]
        left = sum(recent) / len(recent) * (self.cfg.steps - step)
        limit = getattr(self.cfg, "time_limit_min", 0.0)
        if limit and self.t_ready is not None:
            left = min(left, max(0.0, limit * 60 - (time.time() - self.t_ready)))
        return left

    def line(self, r: dict) -> str:
        rewards = [x["reward_mean"] for x in self.recent]
        return (f"step {r['step']:4d}/{self.cfg.steps} | v{r['version']} | reward {r['reward_mean']:.3f} "
                f"(avg10 {sum(rewards) / len(rewards):.3f}) | stale max {r['staleness_max']} mean "
                f"{r['staleness_mean']:.2f} | dropped {r['samples_dropped_stale']} "
                f"filtered {r['groups_filtered']} | "
                f"{r['time_step']:.2f}s (wait {r['time_wait_rollout']:.2f} train {r['time_train']:.2f} sync "
                f"{r['time_weight_sync']:.2f}) | {r['samples_per_s']:.1f} samples/s | util "
                f"{r.get('rollout_utilisation', 0.0):.2f}"
                + (f" | {r['round']} round, {r['prompts_deferred']} deferred, long queue {r['long_queue']}"
                   if "round" in r else "")
                + f" | eta {fmt_s(self.eta(r['step']))}"
                + "".join(f" | {k.removeprefix('eval_').replace('_at_', '@')} {v:.3f}" for k, v in r.items()
                          if k.startswith("eval_") and k != "eval_version" and v is not None))

    def finish(self, extra: str = ""):
        """End of the run: the last events, the tracker closed, the summary."""
        if self.events is not None:
            self.events.add({"ev": "end", "t": time.time(),
                             "requests_not_written": self.events.requests_not_written})
        self.close()
        print0(self.summary() + (f"\n  {extra}" if extra else ""))

    def close(self):
        """Write what is pending and close the tracker; idempotent (train.py calls it on a crash too)."""
        if self.events is not None:
            self.events.flush()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def summary(self, t_end: float | None = None) -> str:
        n, t_end, tot = self.num_rows, t_end or time.time(), self.totals
        if not n:
            return f"run ended after {fmt_s(t_end - self.t_start)}: no step completed"
        t_ready = self.t_ready or self.t_start
        after = t_end - t_ready                      # everything after start-up
        parts = {"wait for rollout": tot["time_wait_rollout"], "train": tot["time_train"],
                 "weight sync": tot["time_weight_sync"]}
        parts["rest"] = max(0.0, after - sum(parts.values()))   # advantages, probes, logging, checkpoints

        def mean(key, rs):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else float("nan")
        k = min(10, max(1, n // 2))                 # first k vs last k steps: apart when there are 2+
        lines = [f"run done: {n} steps in {fmt_s(t_end - self.t_start)} "
                 f"(start-up {fmt_s(t_ready - self.t_start)}, then {after / n:.2f}s per step)",
                 f"  reward     {mean('reward_mean', self.first[:k]):.3f} (first {k} steps) -> "
                 f"{mean('reward_mean', list(self.recent)[-k:]):.3f} (last {k})"]
        for key, ((s0, v0), (s1, v1)) in sorted((k_, (e[0], e[-1])) for k_, e in self.evals.items()):
            lines.append(f"  {key:<10} {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})")
        lines += [
            "  time       " + " | ".join(f"{name} {v / after:.0%}" for name, v in parts.items())
            + f"  (of {fmt_s(after)} after start-up)",
            f"  samples    {tot['samples_dropped_stale']} dropped as stale, "
            f"{tot['groups_filtered']} groups filtered (all rewards equal), {tot['samples_failed']} failed"]
        tail = any("round" in r for r in self.first)
        if tail or getattr(getattr(self.cfg, "train", None), "stream_trainer", False):   # (their own line)
            busy = tot["time_trainer_busy"] / max(tot["time_step"], 1e-9)
            aborted = tot["tokens_aborted"] / max(tot["tokens_generated"], 1)
            lines.append(
                f"  trainer    busy {busy:.0%} of the step time"
                + (f"; tail batching: {tot['prompts_deferred']} prompts deferred, {tot['long_rounds']} long "
                   f"rounds, {aborted:.1%} of generated tokens aborted" if tail else ""))
        lines += [
            f"  files      {self.path}" + (f", {self.events.path}" if self.events is not None else "")
            + (f", {self.out / 'tensorboard'}" if self.cfg.tracker == "tensorboard" else "")
            + f"; checkpoint {self.out / 'checkpoint'}",
            f"  pictures   python -m tools.plot {self.out}"]
        if self.events is not None and (self.events.requests_not_written
                                        or self.events.requests_dropped_by_ranks):
            lines.append(f"  timeline   "
                         f"{self.events.requests_not_written + self.events.requests_dropped_by_ranks} "
                         f"request events not written (over --max-events {self.cfg.max_events} "
                         f"or a rank's cap)")
        return "\n".join(lines)


# The probe's largest |engine - trainer| logprob that is rounding, not a fault: float32 on both sides
# agrees to ~5e-6 (the default run); bfloat16 on either side (--precision bf16, --dtype bfloat16) rounds
# every weight and activation to 8 bits (measured: DESIGN.md#precision---precision)
PROBE_TOLERANCE = {"fp32": 1e-4, "bf16": 0.25}


def probe_verdict(diff: float, cfg) -> str:
    """'probe diff X', judged at the run's precision: bf16's tolerance if the trainer or the engines
    compute in 16 bits, else float32's."""
    kind = ("bf16" if getattr(cfg.train, "precision", "fp32") == "bf16"
            or cfg.rollout.dtype not in ("float32", "auto") else "fp32")
    tol = PROBE_TOLERANCE[kind]
    return (f"probe diff {diff:.1e} (within {kind}'s {tol:g})" if diff <= tol else
            f"probe diff {diff:.1e} ABOVE {kind}'s {tol:g}: do the engines hold the trainer's weights?")


def trim_metrics(out_dir: str, step: int):
    """Resume: drop the rows a crashed run wrote after its last checkpoint (they are trained again)."""
    path = Path(out_dir) / "metrics.jsonl"
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        keep = [line for line in rows if json.loads(line)["step"] <= step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)


def eval_line(e: dict) -> str:
    return f"evaluation of version {e['eval_version']}: " + ", ".join(
        f"{k.removeprefix('eval_').replace('_at_', '@')} {v:.3f}" for k, v in e.items()
        if k != "eval_version")
