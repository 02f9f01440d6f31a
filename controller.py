"""controller.py: the AsyncController (on trainer rank 0) and rl_step, the loop every runner shares.

    step = await rl_step(ctrl, backend, send, layout, spec)  # collect -> train -> sync weights
    # = batch, info = await ctrl.collect(backend.add)         # admit prompts under the async ratio, B groups
    #   metrics, probe = await backend.finish()               # advantages, train (WholeBatch: at once)
    #   sync = await ctrl.sync_weights(version + 1, send, layout, spec=spec)  # into the engines

Admission (async ratio alpha, the Admission policy): at most (alpha + 1) * B groups hold places (admitted,
neither lost nor trained by an earlier step), plus --redundant ones for dynamic filtering; alpha = 0 is the
synchronous baseline in the same code. Rollout modes: "queue" ends a step as soon as B good groups are in;
"batch" (the paper's baseline) waits for every admitted group (a barrier). The trainer waits only for the
broadcast of a weight sync; the SYNCED acks are awaited by the next sync_weights (one sync in flight at
most).
Two seams: an Admission policy decides how many groups may be in flight and which prompt runs next
(ext/tail_batching.py is one); a TrainBackend trains a step's groups (WholeBatch: once the batch is
complete; ext/stream_trainer.py: each group as it completes). `taps` see every sample first (ext/eval.py).
The command/ack protocol, its table and its timeouts: DESIGN.md#the-control-protocol.
"""

import asyncio
import collections
import dataclasses
import itertools
import re
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

import runlog
from buffer import (ORDERS, Ack, Cmd, Command, Freshness, GroupAssembler, Lost, Phase, RolloutTask,
                    SampleBuffer, now)
from config import check, flag, opt
from losses import estimate_advantages
from task import Problem


@dataclass
class ControllerConfig:
    batch_groups: int = opt(32, "B: prompts (GRPO groups) per training step")
    group_size: int = opt(8, "G: samples per prompt")
    async_ratio: int = opt(2, "max policy versions a trained sample may lag the trainer; 0 = synchronous")
    redundant: int = opt(4, "extra prompts admitted per step for dynamic filtering")
    replicate: bool = opt(True, "prompt replication: a prompt's samples spread over all engines")
    rollout_mode: str = opt("queue", "queue (per-sample scheduling) | batch (barrier baseline)")
    filter_groups: bool = opt(True, "dynamic filtering: drop groups whose rewards are all equal (DAPO)")
    sample_order: str = opt("oldest", "complete groups go to the trainer " + " | ".join(ORDERS)
                            + " first (within the async ratio)")
    env: str = opt("", "multi-turn environment name (rollout.ENVS: ext/ adds guess, chain, calc); empty = "
                       "single-turn RLVR")
    env_redundancy: int = opt(0, "multi-turn: extra trajectories per group; the first group-size to finish "
                                 "are kept")
    max_gen_batches: int = opt(0, "dynamic filtering: once a step's complete groups (filtered or kept) "
                                  "reach this many batches (x --batch-groups) and its batch is still short, "
                                  "stop resampling (verl's max_num_gen_batches); 0 = no bound")
    on_max_gen_batches: str = opt("error", "at --max-gen-batches: error (end the run, saying why) | train "
                                           "(train this step on the groups that are ready)")
    timeout_s: float = opt(600.0, "max wait for any queue, ack or collective before failing (also: no new "
                                  "ready group for this long is a stall)")
    startup_timeout_s: float = opt(1800.0, "max wait for each start-up phase: an engine's start (vLLM's own "
                                           "VLLM_ENGINE_READY_TIMEOUT_S is set a minute above it), a rollout "
                                           "rank's connect to the queue server, the engines' READY")
    heartbeat_s: float = opt(10.0, "while collecting a step, a progress line this often, seconds")
    max_failed_share: float = opt(0.95, "end the run (exit non-zero, naming the commonest reasons) once at "
                                        "least this share of the last samples received failed (a window of "
                                        "two batches' worth, at least 64); 1 = only when every one failed")
    def __post_init__(self):
        check(self, at_least=dict(batch_groups=1, group_size=1, async_ratio=0, redundant=0, env_redundancy=0,
                                  max_gen_batches=0),
              above=dict(timeout_s=0, startup_timeout_s=0, max_failed_share=0),
              at_most=dict(max_failed_share=1),
              one_of=dict(sample_order=ORDERS, rollout_mode=("queue", "batch"),
                          on_max_gen_batches=("error", "train")))
        if self.filter_groups and self.group_size < 2:
            raise ValueError(f"--group-size {self.group_size} with dynamic filtering: a group of one sample "
                             f"always has all-equal rewards, so every group would be filtered and no batch "
                             f"could form; use --group-size >= 2")
        from rollout import ENVS
        if self.env not in ENVS:
            raise ValueError(f"--env {self.env!r}: no such environment; known: "
                             f"{', '.join(k for k in ENVS if k)} (empty: single-turn RLVR)")


STALE_WARN_SHARE = 0.25      # a step that drops more of its samples as stale warns (once a run)
# the assembler's counters whose change over a step its info reports (AsyncController.this_step)
STEP_COUNTERS = ("samples_dropped_stale", "groups_filtered", "groups_completed", "samples_failed",
                 "samples_surplus")


class FailureBreaker:
    """Ends a run in which (nearly) every sample fails, which would otherwise retry and re-admit for ever (a
    judge whose context is too short, a verifier that always raises, an env whose reset always fails): once
    the last `window` samples received are in and at least `share` of them failed, raise, naming the
    commonest reasons (numbers left out, so that one reason's samples count together) with their counts.
    Evaluation samples and a rank's notices (its own aborts) do not count."""

    def __init__(self, window: int, share: float):
        self.share, self.recent, self.failed = share, collections.deque(maxlen=window), 0

    def add(self, s, who: str):
        if s.notice or s.meta.get("eval"):
            return
        if len(self.recent) == self.recent.maxlen:
            self.failed -= self.recent[0] is not None
        self.recent.append(str(s.meta.get("error", "?")) if s.failed else None)
        self.failed += s.failed
        if len(self.recent) < self.recent.maxlen or self.failed < self.share * len(self.recent):
            return
        reasons = collections.Counter(re.sub(r"\d+", "N", e) for e in self.recent if e is not None)
        last = {re.sub(r"\d+", "N", e): e for e in self.recent if e is not None}      # an example of each
        top = "; ".join(f"{n} x {last[k][:300]}" for k, n in reasons.most_common(3))
        raise RuntimeError(f"{who}: {self.failed} of the last {len(self.recent)} samples failed (at least "
                           f"--max-failed-share {self.share:g} of them): a failure every sample meets, so "
                           f"the run stops (the last checkpoint stays as it was). Commonest reasons: {top}")


class Admission:
    """How many groups may be in flight and which prompt runs next: the async ratio's bound (module
    docstring). Another policy (ext/tail_batching.py) overrides these; the controller calls each at the
    point its name says."""

    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg

    def begin_step(self, ctrl) -> int:
        """A step's collect starts; returns the groups to admit now, whatever the capacity."""
        return 0

    def capacity(self, ctrl) -> int:
        """How many more groups may be admitted now: alpha + 1 batches and the redundant groups, less the
        places held (ctrl.groups_holding_places)."""
        limit = (ctrl.freshness.max_lag + 1) * self.cfg.batch_groups + self.cfg.redundant
        return limit - ctrl.groups_holding_places()

    def next_problem(self) -> Problem | None:
        """A prompt of the policy's own to admit next (None: the stream's next)."""
        return None

    def admitted(self, gid: str, version: int) -> int:
        """Group gid was admitted at `version` (its problem: ctrl.problem_of[gid]); returns how many samples
        it runs (the first G make it)."""
        return self.cfg.group_size + (self.cfg.env_redundancy if self.cfg.env else 0)

    def eligible(self, ready: list[list]) -> list[list]:
        """The ready groups (GroupAssembler.ready, in its order) this step may still take, in the order to
        take them (a per-domain quota: ext/domains.py); default: all of them."""
        return ready

    def taken(self, gid: str):
        """The group joins the batch being collected."""

    def resolved(self, gid: str):
        """The group was trained or lost (filtered, failed, stale): forget it."""

    async def end_step(self, ctrl) -> dict:
        """The batch is complete; returns the step's metrics of the policy's own."""
        return {}

    def counters(self, ctrl) -> dict:
        """The policy's own totals for rollout_stats.json."""
        return {}

    def state(self, ctrl) -> dict:
        """For a checkpoint: the prompts admitted and not yet trained or lost ("in_flight": Problems)."""
        return {"in_flight": ctrl.in_flight_problems()}

    def restore(self, ctrl, state: dict):
        """Resume: the checkpoint's prompts in flight (and any other policy's queues) run first."""
        ctrl.readmit.extend(state.get("in_flight", []) + state.get("long_queue", []))


class AsyncController:
    def __init__(self, cfg: ControllerConfig, buffer: SampleBuffer, problems, num_rollout_ranks: int,
                 version: int = 0, prompt_len=None, max_model_len: int = 0, log=None,
                 admission: Admission | None = None, recovery=None, freshness: Freshness | None = None):
        self.cfg, self.buffer, self.num_ranks, self.version = cfg, buffer, num_rollout_ranks, version
        self.problems = problems              # iterator of task.Problem (position saved in checkpoints)
        self.version0 = version               # admission counts versions from here (resume, reuse)
        # the freshness rule (the async ratio's, or an Extension's): the assembler holds it (`freshness`)
        self.assembler = GroupAssembler(cfg.group_size, freshness or Freshness(cfg.async_ratio),
                                        cfg.filter_groups, cfg.sample_order)
        self.admission = admission or Admission(cfg)
        self.groups_admitted = self.groups_taken = 0
        self.groups_drawn = 0                  # problems taken from the stream since data_position0
        self.data_position0 = 0                # the stream's position at the start (a resume's: restore())
        self.next_group = 0                    # the next group id's number: g0, g1, ... (continued on resume:
                                               # a group's env seed is its id's hash, so no game is replayed)
        self.problem_of: dict[str, Problem] = {}   # unresolved groups' problems (a lost one is re-admitted)
        self.readmit: collections.deque[Problem] = collections.deque()   # problems to admit again first
        self.prompt_len = prompt_len           # (Problem) -> its prompt's tokens as the engine will see them
        # the engines' context: longer single-turn prompts are refused (0: no check)
        self.max_model_len = max_model_len
        self.log = log                         # (str) -> None: heartbeats and refusals; None: silent
        self.prompts_rejected = 0
        self.taps: list = []                   # async (sample) -> True if it took the sample (ext/eval.py)
        self.failed_received = 0               # failed samples received (every env failure a rank reported)
        self.samples_unconsumed = 0            # samples still queued at stop (counted, never trained)
        self.trained_groups: dict[str, int] = {}   # group -> version trained at (recent ones: duplicates)
        self.acks: list[Ack] = []              # acks received but not yet waited for
        self.in_flight: tuple | None = None    # (version, probe_ref) of the sync awaiting its SYNCED acks
        self.unreported: dict = {}             # wait_ready's check, reported by the first finish_sync
        self.last_engine: dict[int, dict] = {} # rank -> engine stats at its previous SYNCED ack
        # the weight sync's transport (set by each sync_weights): send_fn(spec) broadcasts the trainer's
        # current weights as `spec` says (weight_sync.GroupSpec; None: engines without one, the fake)
        # probe_ref: the trainer's probe logprobs of the last sync (None: not probed)
        self.send_fn = self.layout = self.spec = self.probe_ref = None
        self.gen = 0                           # the weight-sync group's generation: +1 per replaced engine
        self.sends = 0                         # broadcasts started (every attempt)
        # what syncs a replaced engine and retries a broadcast an engine died under (ext/recovery.py); None:
        # a failed broadcast ends the run
        self.recovery = recovery
        self._t_recovery = 0.0
        # optional ext.timeline.EventLog (add / extend): the timeline's events, None records nothing. The
        # controller adds each step's spans (wall clock, time.time()) and the events the ranks' acks carry
        self.events = None
        self._collect_span: list[float] = []  # wall clock [start, end] of the last collect()
        self.batch: list = []                  # the last step's samples (collect's batch)
        # dynamic filtering's spin warning is given once a run; so is that of a step that dropped many stale
        self._warned_filtering = self._warned_stale = False
        self.breaker = FailureBreaker(max(2 * cfg.batch_groups * cfg.group_size, 64), cfg.max_failed_share)
        self._begin_step()                     # (a step's state, as at a step's start)

    @property
    def freshness(self) -> Freshness:
        """The freshness rule: the assembler's, admission's, and every SYNC's."""
        return self.assembler.freshness

    @freshness.setter
    def freshness(self, rule: Freshness):
        self.assembler.freshness = rule

    # --- schedule
    def _groups_ended_untrained(self) -> int:
        """Admitted groups that ended without being trained: filtered, or lost for a reason of Lost."""
        return self.assembler.groups_filtered + sum(getattr(self.assembler, f"groups_{why}") for why in Lost)

    def groups_holding_places(self) -> int:
        """Admitted groups that hold a place under the async ratio: not lost or filtered, and not trained by
        an earlier step (this step's batch holds its places until it trains). Counting what was really
        trained, not B a step, keeps the bound when a step trains fewer groups (--on-max-gen-batches)."""
        return self.groups_admitted - self._groups_ended_untrained() - self.taken_before_step

    def _next_problem(self) -> Problem:
        """The next prompt to admit: one to run again first, else the stream's next that the engine can
        take (single-turn: the prompt's tokens are known here; a multi-turn env's first observation is
        not): one that does not fit its context, or holds a character its tokenizer has no token for, is
        refused, counted and logged, not retried."""
        if self.readmit:
            return self.readmit.popleft()
        if (own := self.admission.next_problem()) is not None:
            return own
        for _ in range(10_000):
            problem = next(self.problems)
            self.groups_drawn += 1
            if not (self.prompt_len and self.max_model_len and not self.cfg.env):
                return problem
            try:
                n = self.prompt_len(problem)
                if n < self.max_model_len:
                    return problem
                why = f"a prompt of {n} tokens (the engine's context is {self.max_model_len})"
            except ValueError as e:                  # (rollout.PromptFormat: an unknown character)
                why = str(e)
            self.prompts_rejected += 1
            # the 1st, 2nd, 4th, 8th...
            if self.log and self.prompts_rejected & (self.prompts_rejected - 1) == 0:
                self.log(f"refused {why}; {self.prompts_rejected} refused so far: {problem.prompt[:120]!r}")
        raise ValueError(f"{self.buffer.who}: 10000 prompts in a row refused (the last: {why}); raise "
                         f"--max-model-len or fix the data")

    async def admit(self, at_least: int = 0) -> int:
        """Admit as many groups as admission allows (at least `at_least`: Admission.begin_step's)."""
        n = max(0, self.admission.capacity(self), at_least)
        tasks = []
        for _ in range(n):
            gid, self.next_group = f"g{self.next_group}", self.next_group + 1
            problem = self.problem_of[gid] = self._next_problem()
            samples = self.admission.admitted(gid, self.version)
            if samples > self.cfg.group_size:
                self.assembler.expect(gid, samples)            # redundancy: the first G make the group
            per_task = 1 if self.cfg.replicate else samples      # prompt replication: a task a sample
            tasks += [RolloutTask(f"{gid}.{j}", gid, problem, per_task, self.version, self.cfg.env)
                      for j in range(samples // per_task)]
        if tasks:
            await self.buffer.put_tasks(tasks)     # one round trip for the whole round
        self.groups_admitted += n
        return n

    # --- run: collect one batch
    async def collect(self, on_group=None, stream: bool = False) -> tuple[list, dict]:
        """Admit and collect until B complete groups are in; returns (their samples, the step's info).
        Each group of the batch is handed to on_group(samples) (a TrainBackend's add): at the end, or with
        `stream` as soon as it is complete, in the order it completed (--sample-order oldest's)."""
        cfg = self.cfg
        self._begin_step()                                 # the step's clock and counters
        await self.admit(at_least=self.admission.begin_step(self))
        committed: list[list] = []                         # groups already handed to on_group
        while True:
            if stream:
                self._commit(committed, on_group)
            n_ready = len(committed) + len(self.admission.eligible(self.assembler.ready))
            if n_ready >= cfg.batch_groups and (cfg.rollout_mode == "queue" or self._all_admitted_done()):
                break                                      # B complete, fresh groups (batch mode: all in)
            s = await self._next_sample(n_ready)           # (None: a second passed without one)
            if s is None:
                continue
            await self._add(s)                             # into its group; a lost group's work stops
            n_ready = len(committed) + len(self.admission.eligible(self.assembler.ready))
            if n_ready < cfg.batch_groups and self._filtering_spins(n_ready):
                break                                      # --on-max-gen-batches train: what it has
            # lost groups free admission capacity: queue mode refills at once; batch mode only starts
            # another round once the whole round is in (its barrier), and only when filtering left it
            # short of a batch
            if cfg.rollout_mode == "queue" or (n_ready < cfg.batch_groups and self._all_admitted_done()):
                await self.admit()
        self._commit(committed, on_group)
        return await self._end_step(committed)

    def _begin_step(self):
        """A step's collect begins: its clocks, the assembler's STEP_COUNTERS then (`before`: this_step
        subtracts them), its samples' rewards, and groups_taken then."""
        self._t0, self._wall0 = now(), time.time()
        self.before = {k: getattr(self.assembler, k) for k in STEP_COUNTERS}
        self.step_rewards: list[float] = []
        self.taken_before_step = self.groups_taken
        # a stall: no new ready group for timeout_s
        self._ready, self._t_progress = self.assembler.num_ready(), now()
        self._t_beat = now()

    def this_step(self) -> dict:
        """The change of the assembler's STEP_COUNTERS since this step's collect began."""
        return {k: getattr(self.assembler, k) - v for k, v in self.before.items()}

    async def _next_sample(self, n_ready: int):
        """The next sample, or None after waiting up to a second for one. Meanwhile, the watch over the
        step: the heartbeat line every --heartbeat-s, the stall report after --timeout-s without a new
        ready group, a replaced engine's resync (ext/recovery.py). A sample a tap takes (ext/eval.py's
        evaluation: scored, never trained) is not returned."""
        cfg = self.cfg
        if n_ready > self._ready:
            self._ready, self._t_progress = n_ready, now()
        if self.log and now() - self._t_beat >= cfg.heartbeat_s:
            self._t_beat = now()
            self.log(runlog.collect_line(self, now() - self._t0))
        waited = now() - self._t_progress
        if waited > cfg.timeout_s:
            raise TimeoutError(runlog.stall_report(self))
        if self.recovery is not None and now() - self._t_recovery >= 1.0:
            self._t_recovery = now()
            await self.recovery.serve(self)                # a replaced engine waits for weights
        try:
            s = await self.buffer.get_sample(timeout=min(cfg.timeout_s - waited, cfg.heartbeat_s, 1.0))
        except TimeoutError:
            return None
        self.received(s)
        self.breaker.add(s, self.buffer.who)          # (raises when nearly every sample fails)
        for tap in self.taps:                              # (ext/eval.py's evaluation samples)
            if await tap(s):
                return None
        return s

    def received(self, s):
        """Every sample taken off the queue passes here once (collect's, a tap's, evaluation's last round,
        stop's): a failed one is counted as the rank that sent it counted it (a notice is no failure)."""
        self.failed_received += s.failed and not s.notice

    async def _add(self, s):
        """A sample into its group (the assembler). A group it leaves lost (given up, or stale) has its
        other samples aborted, and is admitted again when that was not the prompt's fault (its engine
        died, --colocate's sleep); a group it completes under redundancy has the rest aborted (surplus)."""
        assembler, gid = self.assembler, s.group_id
        # (a group running redundant samples is in `expected` until it completes or is lost)
        alive_before, redundant = gid not in assembler.dead, gid in assembler.expected
        assembler.add(s, self.version)
        if not s.failed:
            self.step_rewards.append(s.reward)
        if alive_before and gid in assembler.dead:
            await self.abort_groups([gid])                # lost: stop its other samples
            if gid in self.problem_of and (s.meta.get("engine_lost")
                                           or assembler.lost[gid] is Lost.INTERRUPTED):
                self.readmit.append(self.problem_of[gid])
        elif redundant and gid in assembler.closed:
            await self.abort_groups([gid])                 # it completed: the rest is surplus
        if gid in assembler.dead or (gid in assembler.closed and not assembler.is_ready(gid)):
            self._forget(gid)                              # lost or filtered: no longer a prompt in flight

    async def _end_step(self, groups: list[list]) -> tuple[list, dict]:
        """The batch is complete: its samples and the step's info (rewards, staleness, what was dropped)."""
        if not groups:     # (a step ended early by --max-gen-batches, with every ready group gone stale)
            raise RuntimeError(runlog.spin_report(self, "and no group is left to train on"))
        batch = [s for g in groups for s in g]
        seen = {(s.task_id, s.meta.get("sample_index", 0)) for s in batch}
        duplicate = len(batch) - len(seen) + sum(len(g) for g in groups
                                                 if g[0].group_id in self.trained_groups)
        # bounded, as the assembler's ids
        horizon = self.version - self.freshness.max_lag - GroupAssembler.FORGET_AFTER
        self.trained_groups = {g: v for g, v in self.trained_groups.items() if v >= horizon}
        self.trained_groups.update((g[0].group_id, self.version) for g in groups)
        policy = await self.admission.end_step(self)
        staleness = [self.version - s.oldest_version for s in batch]
        info = {
            "time_wait_rollout": now() - self._t0,
            "reward_mean": sum(self.step_rewards) / max(len(self.step_rewards), 1),
            "reward_trained_mean": sum(s.reward for s in batch) / len(batch),
            "staleness_max": max(staleness), "staleness_mean": sum(staleness) / len(staleness),
            **self.this_step(),                              # (groups_completed: kept or filtered)
            "samples_duplicate": duplicate, "prompts_rejected": self.prompts_rejected,
            "num_samples": len(batch), "num_tokens": sum(s.num_tokens for s in batch),
            "response_len_mean": sum(len(s.response_ids) for s in batch) / len(batch),
            "turns_mean": sum(s.num_turns for s in batch) / len(batch),     # model turns per sample
            **policy,
        }
        self._collect_span = [self._wall0, time.time()]
        self.batch = batch                 # (the extensions' after_step reads the step's samples here)
        self._warn_stale(info, len(self.step_rewards))
        self.freshness.end_step(self, info)
        return batch, info

    def _warn_stale(self, info: dict, received: int):
        """Once a run: a step that dropped more than STALE_WARN_SHARE of the samples it received as stale,
        naming the rule and the flags (admission ran work the rule then threw away)."""
        dropped = info["samples_dropped_stale"]
        if self.log and not self._warned_stale and dropped > STALE_WARN_SHARE * max(received, 1):
            self._warned_stale = True
            self.log(f"step {self.version - self.version0 + 1}: {dropped} of the {received} samples received "
                     f"were dropped as stale under the freshness rule {self.freshness}, with admission "
                     f"{type(self.admission).__name__} (--batch-groups {self.cfg.batch_groups}, --redundant "
                     f"{self.cfg.redundant}): the work admitted outlives the rule; raise --async-ratio or "
                     f"admit less")

    def _filtering_spins(self, n_ready: int) -> bool:
        """Dynamic filtering that keeps resampling: warn once a run when most of a step's complete groups
        were filtered; once the groups completed in this step (filtered or kept; ready groups carried over
        from earlier steps are not this step's work) reach --max-gen-batches batches, fail with a clear
        error (--on-max-gen-batches error) or end the step with what is ready (train: True)."""
        cfg, step = self.cfg, self.this_step()
        filtered, completed = step["groups_filtered"], step["groups_completed"]
        if (self.log and not self._warned_filtering and filtered >= 2 * cfg.batch_groups
                and filtered >= 4 * n_ready):
            self._warned_filtering = True
            self.log(f"dynamic filtering: {runlog.spin_report(self)}. --max-gen-batches N bounds the "
                     f"resampling per step; --filter-groups false trains on such groups")
        if not cfg.max_gen_batches or completed < cfg.max_gen_batches * cfg.batch_groups:
            return False
        if cfg.on_max_gen_batches == "error" or n_ready == 0:
            raise RuntimeError(f"{self.buffer.who}: --max-gen-batches {cfg.max_gen_batches} reached: "
                               + runlog.spin_report(self, f"and only {n_ready} of {cfg.batch_groups} "
                                                           f"groups are ready (--on-max-gen-batches train "
                                                           f"trains what is ready)"))
        return True

    def _commit(self, committed: list, on_group):
        """Hand the ready groups to the trainer (on_group), up to the batch."""
        for g in self.assembler.take(self.cfg.batch_groups - len(committed), self.version, self.admission):
            committed.append(g)
            self.groups_taken += 1
            self.admission.taken(g[0].group_id)
            self._forget(g[0].group_id)
            if on_group is not None:
                on_group(g)

    def _forget(self, gid: str):
        """A group was trained or lost: no longer a prompt in flight."""
        self.problem_of.pop(gid, None)
        self.admission.resolved(gid)

    def in_flight_problems(self, skip=()) -> list[Problem]:
        """Prompts admitted and not yet trained or lost, oldest first (groups in `skip` left out): a
        checkpoint keeps them, so a resumed run admits them again instead of skipping them."""
        return list(self.readmit) + [p for g, p in self.problem_of.items() if g not in skip]

    def _all_admitted_done(self) -> bool:
        """Batch mode barrier: every admitted group is either complete or lost."""
        untrained = self._groups_ended_untrained()
        return not self.assembler.pending and self.buffer.num_queued_tasks() == 0 and \
            self.groups_admitted - untrained - self.groups_taken == self.assembler.num_ready()

    async def abort_groups(self, group_ids: list[str]):
        """Every rank aborts these groups' work (their samples no longer wanted: lost, surplus, deferred)."""
        for r in range(self.num_ranks):
            await self.buffer.send_command(r, Command(Cmd.ABORT_GROUPS, group_ids=group_ids))

    # --- postprocess: weight sync, overlapped with the next step
    async def sync_weights(self, new_version: int, send_fn, layout=None, probe_ref: list[float] | None = None,
                           spec=None) -> dict:
        """Send SYNC to every rollout rank and broadcast (send_fn(spec), a blocking collective with
        the engines' workers, run in a thread; or a coroutine function, awaited: the simulator's model
        of the transfer); return when the broadcast is done. Each rank then
        resumes and acks SYNCED on its own while the trainer goes on; those acks are awaited at the
        next call (one sync in flight at most) or by finish_sync(). layout: the weights' (name, shape,
        dtype); spec: the weight-sync group's (weight_sync.GroupSpec, any generation).
        probe_ref: the trainer's logprobs of the probe, which the ranks then score too. Returns
        trainer-side timings plus the report of the previous sync (see finish_sync)."""
        t0, wall0 = now(), time.time()
        report = await self.finish_sync()
        t1, wall1 = now(), time.time()
        self.send_fn, self.layout, self.spec, self.probe_ref = send_fn, layout, spec, probe_ref
        await self._send_weights(new_version, probe_ref is not None)
        t2 = now()
        if self.events is not None and self._collect_span:   # the trainer's step, for the timeline
            self.events.add({"ev": "step", "version": new_version, "collect": self._collect_span,
                             "train": [self._collect_span[1], wall0], "wait_sync": [wall0, wall1],
                             "broadcast": [wall1, time.time()]})
        self.version = new_version
        self.in_flight = (new_version, probe_ref)
        # groups that can no longer be fresh: drop them here and stop their running samples
        dropped = self.assembler.evict_stale(self.version)
        for gid in dropped:
            self._forget(gid)
        if dropped:
            await self.abort_groups(dropped)
        return {"time_weight_sync": now() - t0, "time_wait_previous_sync": t1 - t0, "time_broadcast": t2 - t1,
                **report}

    async def _send_weights(self, version: int, probe: bool):
        """SYNC to every rank, then the broadcast. One that fails raises, unless the recovery
        (ext/recovery.py) says to send it again (an engine died under it: a new group generation)."""
        if self.recovery is not None:
            self.recovery.before_send(self)
        for attempt in itertools.count(1):
            self.sends += 1           # (the ipc transport's keys: one sequence number per broadcast)
            spec = self.spec.with_gen(self.gen, self.sends) if self.spec is not None else None
            for r in range(self.num_ranks):    # (the rule travels too: the ranks abort what fails it)
                await self.buffer.send_command(r, Command(Cmd.SYNC, version, self.layout, probe=probe,
                                                          spec=spec, freshness=self.freshness))
            try:      # (a coroutine function: the simulator's model of the transfer; else a blocking call)
                await (self.send_fn(spec) if asyncio.iscoroutinefunction(self.send_fn)
                       else asyncio.to_thread(self.send_fn, spec))
                return
            except Exception as e:
                if self.recovery is None or not await self.recovery.send_failed(self, e, version, attempt):
                    raise

    async def finish_sync(self) -> dict:
        """Wait for the SYNCED acks of the sync in flight, if any, and report what they carry:
        the version they loaded (synced_version), the largest probe difference against the
        trainer's (None if not probed), the engines' utilisation since their previous SYNCED ack,
        and the slowest rank's times: receive (the transfer into its engine, with vLLM's own load),
        suspend + that + resume, and vLLM's own load alone (the engine's workers' time not spent
        waiting in the broadcast)."""
        if self.in_flight is None:           # nothing in flight: what wait_ready found, once
            report, self.unreported = self.unreported, {}
            return report
        version, probe_ref = self.in_flight
        acks = await self._wait_acks(Phase.SYNCED, version)
        self.in_flight = None
        return {"synced_version": version, "sync_probe_max_diff": runlog.probe_diff(acks, probe_ref),
                **runlog.engine_deltas(acks, self.last_engine),
                "time_receive": max(a.timings["receive_s"] for a in acks),
                "time_engine_load": max(a.timings["load_s"] for a in acks),
                "time_vllm_load": max(a.timings.get("vllm_load_s", 0.0) for a in acks)}

    async def _wait_acks(self, phase: Phase, version: int | None, startup: bool = False) -> list[Ack]:
        """Wait until every rollout rank acked `phase` for `version`, within --timeout-s (startup:
        --startup-timeout-s). Acks of other phases that arrive meanwhile are kept for later (each rank's
        acks arrive in the order it sent them). A timeout names the ranks still missing and the flag."""
        def match(a: Ack):
            return a.phase == phase and a.version == version
        name = "startup_timeout_s" if startup else "timeout_s"
        timeout = getattr(self.cfg, name)
        deadline = now() + timeout
        while sum(map(match, self.acks)) < self.num_ranks:
            try:
                self.acks.append(await self.buffer.get_ack(f"{phase} acks",
                                                           timeout=max(0.0, deadline - now())))
            except TimeoutError:
                got = {a.rank for a in self.acks if match(a)}
                missing = [r for r in range(self.num_ranks) if r not in got]
                raise TimeoutError(f"{self.buffer.who}: rollout rank(s) {missing} did not ack {phase}"
                                   + (f" for version {version}" if version is not None else "")
                                   + f" within {timeout:.0f}s ({flag(name)})") from None
        got = [a for a in self.acks if match(a)]
        self.acks = [a for a in self.acks if not match(a)]
        if self.events is not None:
            for a in got:
                self.events.extend(a.events or [])
        return got

    async def wait_ready(self, probe_ref: list[float] | None = None) -> dict:
        """Wait until every rollout rank reports its engine up (ack READY). With probe_ref (the
        trainer's logprobs of the probe), compare the engines' own: do they start from the same
        weights? Returns that check in finish_sync's terms, for version `self.version`."""
        acks = await self._wait_acks(Phase.READY, None, startup=True)
        util = runlog.engine_deltas(acks, self.last_engine)["rollout_utilisation"]
        self.unreported = {"synced_version": self.version, "rollout_utilisation": util,
                           "sync_probe_max_diff": runlog.probe_diff(acks, probe_ref)}
        return self.unreported

    def state(self) -> dict:
        """What a checkpoint keeps for a resume to continue this run (JSON-able): the data stream's
        position, the next group id, and the admission policy's prompts in flight (admitted, not yet trained
        or lost)."""
        return {"data_position": self.data_position0 + self.groups_drawn, "next_group": self.next_group,
                "admission": {k: [dataclasses.asdict(p) for p in v]
                              for k, v in self.admission.state(self).items()}}

    def restore(self, state: dict):
        """Continue the run a checkpoint's state() describes: the stream (built from its data_position by the
        caller) goes on from there, group ids go on, and the prompts that were in flight run first."""
        self.data_position0, self.next_group = state["data_position"], state.get("next_group", 0)
        kept = state.get("admission", {})
        self.admission.restore(self, {k: [Problem(**p) for p in v] for k, v in kept.items()})

    def counters(self) -> dict:
        """The controller's side of the run's bookkeeping (rollout_stats.json)."""
        assembler = self.assembler
        return {"groups_admitted": self.groups_admitted, "groups_taken": self.groups_taken,
                "failed_samples_received": self.failed_received, "groups_failed": assembler.groups_failed,
                "groups_filtered": assembler.groups_filtered,
                "groups_dropped_stale": assembler.groups_dropped_stale,
                "groups_interrupted": assembler.groups_interrupted,
                "samples_surplus": assembler.samples_surplus, "samples_unconsumed": self.samples_unconsumed,
                **self.admission.counters(self)}

    async def stop(self) -> list[dict]:
        """Tell every rollout rank to stop, and wait until each has; returns their counters."""
        for r in range(self.num_ranks):
            await self.buffer.send_command(r, Command(Cmd.STOP))
        stats = [a.stats for a in sorted(await self._wait_acks(Phase.STOPPED, None), key=lambda a: a.rank)]
        # a rank sends its last samples before its STOPPED ack: count what nobody will train on
        while (s := self.buffer.get_sample_nowait()) is not None:
            self.received(s)
            self.samples_unconsumed += 1
        return stats


class TrainBackend:
    """When a step's groups train (rl_step calls these; streaming changes when, not what): WholeBatch below,
    once the batch is complete; ext/stream_trainer.TrainStream, each group as it completes. Its interface:

        streams: bool
            True: add() gets each group as soon as it is complete, not all at the end.
        def begin(self, version)
            A step begins; its batch trains the weights of this version.
        def add(self, group)
            A group of the batch (G samples).
        async def finish(self) -> (metrics, the probe's logprobs or None)
            The batch is complete: train what is left."""


class WholeBatch:
    """The default TrainBackend: a step's groups trained at once, when the batch is complete (collect()
    hands them over at its end). train: async (batch, advantages, version) -> (metrics, probe_ref or None);
    before: async callables run before it trains (--colocate: the engines sleep); estimator:
    --adv-estimator."""
    streams = False

    def __init__(self, train, group_size: int, estimator: str = "grpo", before=()):
        self.train, self.G, self.estimator, self.before = train, group_size, estimator, list(before)

    def begin(self, version: int):
        self.version, self.groups = version, []

    def add(self, group: list):
        self.groups.append(group)

    async def finish(self) -> tuple[dict, list | None]:
        batch = [s for g in self.groups for s in g]
        rewards = torch.tensor([s.reward for s in batch])
        advantages = estimate_advantages(rewards, self.G, self.estimator).tolist()
        for hook in self.before:
            await hook()
        t = now()                                                                 # loop time (sim: virtual)
        metrics, probe_ref = await self.train(batch, advantages, self.version)
        return {**metrics, "time_trainer_busy": now() - t}, probe_ref


class Step(NamedTuple):
    batch: list          # the B groups trained on (B * G samples)
    info: dict           # collect()'s: rewards, staleness, waits, filtering
    metrics: dict        # the trainer's: loss, ratios, clip fraction
    sync: dict           # sync_weights': previous sync's acks (utilisation, probe diff), this broadcast
    train_s: float       # seconds from the batch's completion to the trained weights (event-loop time)


async def rl_step(ctrl: AsyncController, backend, send_fn, layout=None, spec=None) -> Step:
    """One step of the loop every runner shares (train.py, the simulator, the benchmarks, the study):
    collect B fresh groups -> train them (backend: a TrainBackend, WholeBatch or a streaming one, which
    trains each group as it completes; train_s is then what is left once the batch is complete) -> sync
    the new weights into the engines. send_fn, layout, spec: as sync_weights'.
    metrics["time_trainer_busy"]: the trainer's own time in this step's training."""
    backend.begin(ctrl.version)
    batch, info = await ctrl.collect(on_group=backend.add, stream=backend.streams)     # schedule + run
    t = now()
    metrics, probe_ref = await backend.finish()
    train_s = now() - t
    sync = await ctrl.sync_weights(ctrl.version + 1, send_fn, layout, probe_ref, spec)  # postprocess
    return Step(batch, info, metrics, sync, train_s)
