"""runlog.py: what a run records and prints on trainer rank 0: metrics.jsonl, the step line, the summary,
and the controller's reports (its heartbeat, why a step stalls, the engines' numbers between acks).

    log = RunLog(cfg, exts)                         # trainer rank 0 (train.py)
    ready = await log.starting(ctrl.wait_ready())   # says what start-up waits for, then "rollout ready"
    log.step(step, version, info, train, sync, time_train, time_step)  # row, hooks, progress line
    log.finish()                                    # the summary at the end

Files in out_dir: metrics.jsonl (a row per step), rollout_stats.json (at the end). Extensions see every
row (Extension.on_row: trackers, the timeline), add to the step line (step_line) and to the summary
(summary_lines, run_files). What every rank prints besides (library logs): ext/quiet.py.

A weight sync overlaps the next step, so its numbers (synced_version, sync_probe_max_diff,
rollout_utilisation, time_receive, time_engine_load, time_vllm_load) land in the next row;
time_weight_sync is what the trainer itself spent on this step's sync.
"""

import asyncio
import collections
import json
import os
import time
from pathlib import Path

from config import Extensions


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
# the run log


SUMMED = ("time_wait_rollout", "time_train", "time_weight_sync", "samples_dropped_stale", "groups_filtered",
          "samples_failed", "time_step")      # the row keys the summary adds up


class RunLog:
    def __init__(self, cfg, exts=()):
        self.cfg, self.exts = cfg, Extensions(exts)
        self.out = Path(cfg.out_dir)
        self.path = self.out / "metrics.jsonl"
        # this session's rows, bounded (a long run must not grow): the first and the last 10, sums
        self.num_rows = 0
        self.first: list[dict] = []
        self.recent: collections.deque[dict] = collections.deque(maxlen=10)
        self.totals: collections.Counter = collections.Counter()
        self.t_start = process_start()
        self.t_ready: float | None = None

    async def starting(self, awaitable) -> dict:
        """Await the engines' READY (controller.wait_ready, bounded by its own timeout), saying what
        start-up waits for, again every 15 s; then the "rollout ready" line."""
        engines = f"{self.cfg.rollout_gpus} engine{'s' if self.cfg.rollout_gpus > 1 else ''}"
        print0(f"starting {engines} and warming up (on a 2-core CPU: a vLLM engine about 30 s, the "
               f"one-process run's torch engine a few) ...")
        task = asyncio.ensure_future(awaitable)
        while not (await asyncio.wait({task}, timeout=15.0))[0]:
            print0(f"  ... still starting: {time.time() - self.t_start:.0f}s since launch")
        ready = task.result()
        self.t_ready = time.time()
        self.exts.call("on_ready", self.t_ready)
        diff = ready.get("sync_probe_max_diff")
        print0(f"rollout ready: {engines} in {self.t_ready - self.t_start:.1f}s since launch"
               + (f", {probe_verdict(diff, self.cfg)}" if diff is not None else ""))
        return ready

    def step(self, step: int, version: int, info: dict, train: dict, sync: dict, time_train: float,
             time_step: float) -> dict:
        row = {"step": step, "version": version, **info, **train, "time_train": time_train, **sync,
               "time_step": time_step, "samples_per_s": info["num_samples"] / time_step,
               "tokens_per_s": info["num_tokens"] / time_step}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.num_rows += 1
        if len(self.first) < 10:
            self.first.append(row)
        self.recent.append(row)
        self.totals.update({k: row.get(k) or 0 for k in SUMMED})
        self.exts.call("on_row", row)
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
                + "".join(f" | {x}" for x in self.exts.call("step_line", r))
                + f" | eta {fmt_s(self.eta(r['step']))}")

    def write_stats(self, counters: dict, ranks_stats: list[dict]):
        """rollout_stats.json: the controller's counters and every rollout rank's (at stop)."""
        stats = {"controller": counters, "rollout_ranks": [
            {**{k: v for k, v in r.items() if k != "proxy"}, "engine_in_flight": r["proxy"]["in_flight"]}
            for r in ranks_stats]}
        (self.out / "rollout_stats.json").write_text(json.dumps(stats, indent=2))

    def finish(self, extra: str = ""):
        """End of the run: the extensions finish and close, the summary."""
        self.exts.call("on_finish")
        self.close()
        print0(self.summary() + (f"\n  {extra}" if extra else ""))

    def close(self):
        """The extensions write what is pending and close; idempotent (train.py calls it on a crash too)."""
        self.exts.call("close")

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
                 f"{mean('reward_mean', list(self.recent)[-k:]):.3f} (last {k})",
                 "  time       " + " | ".join(f"{name} {v / after:.0%}" for name, v in parts.items())
                 + f"  (of {fmt_s(after)} after start-up)",
                 f"  samples    {tot['samples_dropped_stale']} dropped as stale, {tot['groups_filtered']} "
                 f"groups filtered (all rewards equal), {tot['samples_failed']} failed"]
        lines += [x for xs in self.exts.call("summary_lines", self) for x in xs]
        files = [str(self.path)] + [x for xs in self.exts.call("run_files") for x in xs]
        lines += [f"  files      {', '.join(files)}; checkpoint {self.out / 'checkpoint'}",
                  f"  pictures   python -m tools.plot {self.out}"]
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


def start_line(cfg, world: int, model_dir: str, device: str, state) -> str:
    """The run's first line: its ranks, model, context, dtype, ratio, loss, device, weights."""
    rc = cfg.rollout
    who = f"{world} ranks" if world > 1 else "one process"          # (one: python train.py, no torchrun)
    served = world - cfg.train_gpus - cfg.rollout_gpus if world > 1 else 0    # a teacher's, a judge's ranks
    return (f"train.py: {who} = {cfg.train_gpus} trainer + {cfg.rollout_gpus} rollout"
            + (f" + {served} model server" if served else "") + ", model "
            f"{model_dir} (context {rc.max_model_len}, {rc.dtype}, up to {rc.max_tokens} tokens a turn), "
            f"async ratio {cfg.controller.async_ratio}, loss {cfg.train.loss}, device {device}, weights: "
            f"{cfg.weight_transport}"
            + (f", resuming at step {state['step']} version {state['version']}" if state else ""))


def start_metrics(out_dir: str, state):
    """A fresh run: no metrics.jsonl yet; a resumed one: the rows past its checkpoint go (trim_metrics)."""
    if state:
        trim_metrics(out_dir, state["step"])
    else:
        (Path(out_dir) / "metrics.jsonl").unlink(missing_ok=True)


def trim_metrics(out_dir: str, step: int):
    """Resume: drop the rows a crashed run wrote after its last checkpoint (they are trained again)."""
    path = Path(out_dir) / "metrics.jsonl"
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        keep = [line for line in rows if json.loads(line)["step"] <= step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# what the controller reports (it passes itself: this_step() holds the step's counters so far)


def collect_line(ctrl, elapsed: float) -> str:
    """The heartbeat while a step collects (every --heartbeat-s)."""
    a, step = ctrl.assembler, ctrl.this_step()
    failed = step["samples_failed"]
    last = f" (the last: {a.last_failed.meta.get('error', '?')[:160]})" if failed and a.last_failed else ""
    return (f"  collecting step {ctrl.version - ctrl.version0 + 1} for {elapsed:.0f}s: {a.num_ready()}/"
            f"{ctrl.cfg.batch_groups} groups ready, {len(ctrl.step_rewards)} samples in, {failed} failed"
            f"{last}, {step['groups_filtered']} groups filtered, "
            f"{ctrl.buffer.num_queued_tasks()} tasks queued")


def stall_report(ctrl) -> str:
    """Why no batch could form: what happened to the samples of this step, with an example."""
    assembler, step = ctrl.assembler, ctrl.this_step()
    failed, filtered = step["samples_failed"], step["groups_filtered"]
    msg = (f"{ctrl.buffer.who}: no new group became ready for {ctrl.cfg.timeout_s:.0f}s "
           f"({assembler.num_ready()} of {ctrl.cfg.batch_groups} ready); this step so far: "
           f"{len(ctrl.step_rewards)} samples arrived, {failed} failed, {filtered} groups filtered "
           f"(all rewards equal), {step['samples_dropped_stale']} dropped as stale")
    if failed and assembler.last_failed is not None:
        msg += f"; a failed sample: {assembler.last_failed.meta.get('error', '?')}"
    elif filtered and assembler.last_filtered:
        msg += (f"; a filtered group: rewards {[x.reward for x in assembler.last_filtered]} "
                f"(every sample of a group scored alike: the task too hard or too easy for the model?)")
    elif not ctrl.step_rewards and not failed:
        msg += "; nothing arrived at all: are the rollout ranks alive and pulling tasks?"
    return msg


def spin_report(ctrl, tail: str = "") -> str:
    """Dynamic filtering that keeps resampling: how many of this step's groups it dropped, and why."""
    mean = sum(ctrl.step_rewards) / max(len(ctrl.step_rewards), 1)
    return (f"{ctrl.this_step()['groups_filtered']} groups completed in step "
            f"{ctrl.version - ctrl.version0 + 1} had all-equal rewards (reward mean {mean:.3f}: the task is "
            f"too hard or too easy for the model) {tail}").rstrip()


def engine_deltas(acks: list, last: dict) -> dict:
    """Since each rank's previous SYNCED ack (`last`: rank -> its engine stats then, updated here), over all
    ranks: tokens generated, the model tokens of trajectories aborted (and their share), verifier calls cut
    by the timeout, and the engines' utilisation (busy time / wall time)."""
    d = {key: sum(a.engine.get(key, 0) - last.get(a.rank, {}).get(key, 0) for a in acks)
         for key in ("tokens", "tokens_aborted", "reward_timeouts", "busy_s", "idle_s")}
    for a in acks:
        last[a.rank] = a.engine
    elapsed = d["busy_s"] + d["idle_s"]
    return {"tokens_generated": d["tokens"], "tokens_aborted": d["tokens_aborted"],
            "aborted_token_share": d["tokens_aborted"] / d["tokens"] if d["tokens"] else 0.0,
            "reward_timeouts": d["reward_timeouts"],
            "rollout_utilisation": d["busy_s"] / elapsed if elapsed > 0 else 0.0}


def probe_diff(acks: list, probe_ref: list[float] | None) -> float | None:
    """Largest |engine - trainer| logprob over the probe tokens and ranks; None if not probed (--check-sync-
    every 0: the engines' READY probe has nothing to meet)."""
    diffs = [max(abs(a - b) for a, b in zip(ack.probe, probe_ref)) for ack in acks
             if ack.probe is not None and probe_ref is not None]
    return max(diffs) if diffs else None
