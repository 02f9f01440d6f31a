"""controller.py: the AsyncController, on trainer rank 0.

Each training step is schedule -> run -> postprocess:

    batch, info = await ctrl.collect()          # admit prompts under the async ratio, gather B groups
    ... trainer.train_step(batch) on every trainer rank ...
    await ctrl.sync_weights(send_fn)            # suspend rollout -> broadcast weights -> resume

Admission (the async ratio alpha): the trainer at version v consumes B groups per step, and a
sample may be at most alpha versions older than the trainer that uses it. So the controller keeps
at most (v - v0 + alpha + 1) * B groups "alive" (admitted and not yet lost; v0 = the version the
controller started at) plus `redundant` extra
groups, the head start that dynamic filtering burns. alpha = 0 is the synchronous baseline in the
same code: one batch admitted, collected, trained on, weights updated, repeat. A group that is
filtered or dropped as stale frees its place, so more prompts are admitted to replace it.

Rollout modes:
- "queue": a step ends as soon as B good groups are in; unfinished ones run on (alpha > 0) or are
  aborted when they can no longer be fresh.
- "batch": the paper's batch-rollout baseline: the step waits for every admitted group to finish
  (a barrier), then takes B; if filtering left fewer than B, another round is admitted.

Weight sync is the paper's three phases: every rollout rank is told to suspend (and acks), the
weights are broadcast (send_fn), the ranks load them, resume and ack. Every wait has a timeout.
"""

import asyncio
import itertools
import random
from dataclasses import dataclass

from buffer import Buffer, GroupAssembler, RolloutTask
from proxy import _now   # event-loop time: real in train.py, virtual in sim.py
from task import Problem


@dataclass
class ControllerConfig:
    batch_groups: int = 16        # B: prompts (groups) per training step
    group_size: int = 8           # G: samples per prompt (GRPO group)
    async_ratio: int = 2          # alpha: max versions a trained sample may lag the trainer
    redundant: int = 0            # extra prompts admitted per step for dynamic filtering
    replicate: bool = True        # prompt replication: a group's samples are independent tasks
    rollout_mode: str = "queue"   # "queue" or "batch" (barrier baseline)
    filter_equal: bool = True     # drop groups whose rewards are all equal (DAPO dynamic sampling)
    env: str = ""                 # "" single-turn RLVR, else an environment name
    env_redundancy: int = 0       # extra trajectories per env group; the first G to finish are kept
    timeout_s: float = 600.0      # max wait for a sample or an ack

    def __post_init__(self):
        if self.batch_groups < 1 or self.group_size < 1:
            raise ValueError("ControllerConfig: batch_groups and group_size must be >= 1")
        if self.async_ratio < 0:
            raise ValueError(f"--async-ratio must be >= 0, got {self.async_ratio}")
        if self.rollout_mode not in ("queue", "batch"):
            raise ValueError(f"--rollout-mode must be 'queue' or 'batch', got {self.rollout_mode!r}")


class Controller:
    def __init__(self, cfg: ControllerConfig, buffer: Buffer, problems, num_rollout_ranks: int,
                 version: int = 0):
        self.cfg = cfg
        self.buffer = buffer
        self.problems = problems              # iterator of task.Problem (position saved in checkpoints)
        self.num_ranks = num_rollout_ranks
        self.version = version
        self.version0 = version               # admission counts versions from here (resume, reuse)
        self.asm = GroupAssembler(cfg.group_size, cfg.async_ratio, cfg.filter_equal)
        self.groups_admitted = 0
        self.groups_taken = 0
        self.admitted_by_group: dict[str, int] = {}
        self._gid = itertools.count()
        self.step_rewards: list[float] = []
        self._acks: list[dict] = []            # acks received but not yet waited for

    # --- schedule
    def _groups_lost(self) -> int:
        return self.asm.groups_filtered + self.asm.groups_dropped_stale + self.asm.groups_failed

    def admission_capacity(self) -> int:
        """How many more groups may be admitted now (see module docstring)."""
        alive = self.groups_admitted - self._groups_lost()
        steps = self.version - self.version0 + self.cfg.async_ratio + 1   # batches this controller may have out
        return steps * self.cfg.batch_groups + self.cfg.redundant - alive

    async def admit(self) -> int:
        n = max(0, self.admission_capacity())
        for _ in range(n):
            problem: Problem = next(self.problems)
            gid = f"g{next(self._gid)}"
            tasks_per_group = self.cfg.group_size + (self.cfg.env_redundancy if self.cfg.env else 0)
            if self.cfg.replicate:
                for j in range(tasks_per_group):
                    await self.buffer.put_task(RolloutTask(f"{gid}.{j}", gid, problem, 1, self.version, self.cfg.env))
            else:
                await self.buffer.put_task(RolloutTask(f"{gid}.0", gid, problem, tasks_per_group, self.version, self.cfg.env))
            self.admitted_by_group[gid] = self.version
        self.groups_admitted += n
        return n

    # --- run: collect one batch
    async def collect(self) -> tuple[list, dict]:
        cfg, asm = self.cfg, self.asm
        t0 = _now()
        before = dict(stale=asm.samples_dropped_stale, filtered=asm.groups_filtered, failed=asm.samples_failed,
                      surplus=asm.samples_surplus)
        self.step_rewards = []
        await self.admit()
        while True:
            enough = asm.num_ready() >= cfg.batch_groups
            if enough and (cfg.rollout_mode == "queue" or self._all_admitted_done()):
                break
            s = await self.buffer.get_sample(timeout=cfg.timeout_s)
            closed_before = len(asm.closed)
            asm.add(s, self.version)
            if not s.failed:
                self.step_rewards.append(s.reward)
            if cfg.env and cfg.env_redundancy and len(asm.closed) > closed_before:
                await self._abort_groups([s.group_id])   # redundant env rollout: the rest is surplus
            # lost groups free admission capacity: queue mode refills at once; batch mode only
            # starts another round once the whole round is in (its barrier)
            if cfg.rollout_mode == "queue" or self._all_admitted_done():
                await self.admit()
        groups = asm.take(cfg.batch_groups, self.version)
        self.groups_taken += len(groups)
        batch = [s for g in groups for s in g]
        staleness = [self.version - s.oldest_version for s in batch]
        info = {
            "time_wait_rollout": _now() - t0,
            "reward_mean": sum(self.step_rewards) / max(len(self.step_rewards), 1),
            "reward_trained_mean": sum(s.reward for s in batch) / len(batch),
            "staleness_max": max(staleness), "staleness_mean": sum(staleness) / len(staleness),
            "samples_dropped_stale": asm.samples_dropped_stale - before["stale"],
            "groups_filtered": asm.groups_filtered - before["filtered"],
            "samples_failed": asm.samples_failed - before["failed"],
            "samples_surplus": asm.samples_surplus - before["surplus"],
            "num_samples": len(batch), "num_tokens": sum(s.num_tokens for s in batch),
            "response_len_mean": sum(len(s.response_ids) for s in batch) / len(batch),
        }
        return batch, info

    def _all_admitted_done(self) -> bool:
        """Batch mode barrier: every admitted group is either complete or lost."""
        return not self.asm.pending and self.buffer.num_queued_tasks() == 0 and \
            self.groups_admitted - self._groups_lost() - self.groups_taken == self.asm.num_ready()

    async def _abort_groups(self, group_ids: list[str]):
        for r in range(self.num_ranks):
            await self.buffer.send_command(r, {"cmd": "abort_groups", "group_ids": group_ids})

    # --- postprocess: weight sync, the paper's three phases
    async def sync_weights(self, new_version: int, send_fn, meta=None) -> dict:
        """suspend -> broadcast (send_fn, a blocking collective, run in a thread) -> resume.
        Returns timings and the rollout ranks' acks (which may carry probe logprobs)."""
        t0 = _now()
        for r in range(self.num_ranks):
            await self.buffer.send_command(r, {"cmd": "sync", "version": new_version, "meta": meta})
        await self._wait_acks("suspended", new_version)
        t1 = _now()
        await asyncio.to_thread(send_fn)
        t2 = _now()
        await self._wait_acks("synced", new_version)
        acks = self.pop_acks("loaded", new_version)     # optional extra acks (probe logprobs, engine stats)
        self.version = new_version
        # groups that can no longer be fresh: drop them here and stop their running samples
        dropped = self.asm.evict_stale(self.version)
        if dropped:
            await self._abort_groups(dropped)
        return {"time_weight_sync": _now() - t0, "time_suspend": t1 - t0, "time_broadcast": t2 - t1,
                "acks": acks}

    async def _wait_acks(self, phase: str, version: int) -> list[dict]:
        """Wait until every rollout rank acked `phase` for `version`. Acks of other phases that
        arrive meanwhile are kept for later (each rank's acks arrive in the order it sent them)."""
        def match(a):
            return a.get("phase") == phase and a.get("version") == version
        while sum(map(match, self._acks)) < self.num_ranks:
            self._acks.append(await self.buffer.get_ack(f"weight sync ({phase}, version {version})",
                                                        timeout=self.cfg.timeout_s))
        got = [a for a in self._acks if match(a)]
        self._acks = [a for a in self._acks if not match(a)]
        return got

    def pop_acks(self, phase: str, version: int) -> list[dict]:
        got = [a for a in self._acks if a.get("phase") == phase and a.get("version") == version]
        self._acks = [a for a in self._acks if a not in got]
        return got

    async def wait_ready(self):
        """Wait until every rollout rank reports its engine up (ack phase "ready")."""
        await self._wait_acks("ready", None)

    async def stop(self):
        """Tell every rollout rank to stop, and wait until each has."""
        for r in range(self.num_ranks):
            await self.buffer.send_command(r, {"cmd": "stop"})
        await self._wait_acks("stopped", None)


def problem_stream(problems: list[Problem] | None, seed: int, start: int = 0, make=None):
    """Endless problems: a shuffled pass over a dataset, or generated ones; skips `start` (resume)."""
    rng = random.Random(seed)
    if problems is None:
        gen = (make(rng) for _ in itertools.count())
    else:
        def passes():
            while True:
                order = list(range(len(problems)))
                rng.shuffle(order)
                for i in order:
                    yield problems[i]
        gen = passes()
    return itertools.islice(gen, start, None)
