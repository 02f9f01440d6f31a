"""env_manager.py: the rollout side of one rank. Many concurrent trajectories over one LLMProxy.

    mgr = EnvManager(proxy, buffer, tokenizer, rank=r, cfg=RolloutConfig(...))
    stats = await mgr.run()        # acks READY, then runs until the controller sends Cmd.STOP

EnvManager schedules slots and runs the controller's commands; each slot runs one sample's
environment-level loop, rollout.run_trajectory, which knows nothing of slots or commands. Every
`poll_s` (or at once when a slot frees) the control loop, in one round trip to the queues, sends the
samples that finished, takes this rank's next command (SYNC, ABORT_GROUPS, SLEEP, STOP) and pulls
RolloutTasks into its free slots, at most one task of a group per poll period when other ranks share
the queue (prompt replication spreads a group over the engines with room).
A weight sync (Cmd.SYNC): suspend -> the engine's workers receive the broadcast -> resume -> abort
work that can no longer be fresh -> ack SYNCED. It runs beside the control loop, which meanwhile
still sends finished samples and starts tasks in free slots (they generate after the resume); only
the commands wait for it, so they run one at a time, in order.
Deviations (the env seed per group, staleness from the first token, ...): DESIGN.md#env_managerpy.
"""

import asyncio
import collections
import contextlib
import functools
import math

from buffer import PROBE_TEXT, Ack, Cmd, Command, Freshness, Lost, Phase, RolloutTask, Sample, now
from proxy import EngineError, Status
from rollout import (ENVS, RANK_STATS, Aborted, FixedDeadline, PromptFormat, RolloutConfig, Trajectory,
                     env_seed, inline_reward, run_trajectory)
from task import load_reward


BACKOFF_S = (0.05, 5.0)     # a failed attempt's wait before its slot runs again: doubles per failure in a row


# ---------------------------------------------------------------------------------------------
# the manager: slots, commands, the rollout side of the weight sync


class Slots:
    """A rank's rollout slots (--max-concurrency): a task holds one per sample while it runs. A sample's
    finisher (a teacher's log-probs can take seconds) hands its slot back while it waits (lend), so that
    generation goes on; an attempt that then fails there waits for a free slot before it is tried again,
    ahead of new tasks (`waiting` keeps their places), so `used` never exceeds `n`. `freed` (the manager's
    wake) is set whenever a slot frees."""

    def __init__(self, n: int, freed: asyncio.Event):
        self.n, self.used, self.waiting, self.freed = n, 0, 0, freed
        self.held: dict[str, int] = {}           # task_id -> the slots it holds now

    def free(self) -> int:
        return self.n - self.used - self.waiting

    def take(self, task_id: str, k: int):
        self.held[task_id] = self.held.get(task_id, 0) + k
        self.used += k

    def give(self, task_id: str, k: int | None = None):
        """k of the task's slots back (None: all it holds: the task ended)."""
        held = self.held.pop(task_id, 0)
        k = held if k is None else k
        if held > k:
            self.held[task_id] = held - k
        self.used -= k
        self.freed.set()

    async def lend(self, task_id: str, finish, sample):
        """await finish(sample) with the sample's slot handed back meanwhile; if it fails, the slot is taken
        again (once one is free) before the failure goes on to the attempt's retry."""
        self.give(task_id, 1)
        try:
            await finish(sample)
        except Exception:
            self.waiting += 1
            try:
                while self.used >= self.n:
                    self.freed.clear()
                    await self.freed.wait()
            finally:
                self.waiting -= 1
            self.take(task_id, 1)
            raise


class EnvManager:
    def __init__(self, proxy, buffer, tokenizer, rank: int, cfg: RolloutConfig,
                 freshness: Freshness | int | None = None, sync_timeout_s: float = 600.0,
                 probe_ids: list[int] | None = None, env_wrappers=None, recovery=None, scorer=None,
                 deadline=None, finisher=None):
        """env_wrappers: (env) -> env, applied to every env (ext/faults.py); recovery: what replaces a dead
        engine (ext/recovery.py), None: an engine failure ends the rank; scorer: what scores answers
        (ext/verifiers.py's pool, ext/judge.py: score, stats, shutdown), None: inline; deadline: the env
        calls' (ext/deadlines.py's adaptive one), None: a fixed --env-step-timeout-s; finisher: async (Sample)
        -> None on every finished sample before it is sent (an extension's: a teacher's log-probs), None:
        none."""
        self.proxy, self.buffer, self.rank, self.cfg = proxy, buffer, rank, cfg
        self.fmt = PromptFormat(tokenizer, cfg.chat_template)   # env text <-> tokens
        if not (cfg.max_tokens and cfg.max_model_len):
            raise ValueError("EnvManager: max_tokens and max_model_len of 0 mean 'from the model': "
                             "RolloutConfig.resolved() first")
        # the freshness rule (an int: the async ratio's; None: none) until a SYNC brings the controller's; a
        # sync aborts the running work that can no longer pass it
        self.freshness = None if freshness is None else Freshness.of(freshness)
        self.sync_timeout_s = sync_timeout_s    # a weight sync (suspend to SYNCED ack) longer is an error
        # rollout ranks pulling from the same task queue: one per command queue (1 = pull greedily)
        self.num_ranks = buffer.transport.num_ranks
        # group_id -> loop time this rank last started one of its tasks
        self.group_taken_at: dict[str, float] = {}
        self.probe_ids = probe_ids              # token ids scored after a load if a SYNC asks (Command.probe)
        self.recovery, self.scorer, self.finisher = recovery, scorer, finisher
        self.env_wrappers = env_wrappers
        self.synced = False                     # a sync loaded weights that the model dir does not have
        self.sync_task: asyncio.Task | None = None   # the SYNC being handled, beside the control loop
        self.deadline = deadline or FixedDeadline(cfg.env_step_timeout_s)   # every env call's
        verifier = inline_reward(load_reward(cfg.reward)) if cfg.reward else None   # (None: task.reward)
        self.reward_fn = scorer.score if scorer else verifier
        # held-out evaluation is scored by the task's verifier whatever trains (--reward none: the task's own
        # check; a scorer that is not a verifier, an LLM judge, names its verifier as held_out)
        self.eval_reward_fn = (getattr(scorer, "held_out", scorer.score) if scorer
                               else None if cfg.reward == "none" else verifier)
        self.jobs: dict[str, tuple[RolloutTask, asyncio.Task]] = {}   # task_id -> (task, its asyncio task)
        self.trajs: dict[str, dict[int, Trajectory]] = {}            # task_id -> sample index -> live attempt
        self.aborted_groups: set[str] = set()
        self.held: collections.deque[RolloutTask] = collections.deque()   # pulled, waiting for free slots
        self.outbox: list[Sample] = []          # finished samples, sent on the manager's next pass
        self.fail_streak = 0                    # failed attempts in a row on this rank (_report_failure)
        self.error: BaseException | None = None
        self.wake = asyncio.Event()             # a slot freed or a job crashed: run the control loop now
        self.slots = Slots(cfg.max_concurrency, self.wake)
        self.counters = dict(tasks_started=0, tasks_skipped=0, samples_sent=0, samples_failed=0, retries=0,
                             aborted_stale=0, aborted_by_request=0, aborted_at_stop=0, env_timeouts=0,
                             engine_restarts=0, samples_lost_to_engine=0, tokens_aborted=0)

    def stats(self) -> dict:
        return {**self.counters, "in_flight": self.slots.used,
                "env_deadline_s": dict(self.deadline.current_s),    # {"reset": s, "step": s}, seconds
                **self.reward_stats(), "proxy": self.proxy.stats(), **{k: f() for k, f in RANK_STATS.items()}}

    def reward_stats(self) -> dict:
        """The scorer's timeouts (calls that scored 0 for it) and its deadline now; the tokens this rank
        generated and threw away by aborts (model tokens: trajectories aborted as stale, on request, at
        stop)."""
        pool = self.scorer.stats() if self.scorer else {}
        return {"reward_timeouts": 0, "reward_deadline_s": None, **pool,
                "tokens_aborted": self.counters["tokens_aborted"]}

    # --- control loop

    async def run(self) -> dict:
        probe = await self.proxy.score(self.probe_ids) if self.probe_ids else None   # the initial weights
        await self.buffer.put_ack(Ack(self.rank, Phase.READY, engine=self.proxy.stats(), probe=probe))
        try:
            await self._loop()
        except BaseException:
            with contextlib.suppress(Exception):        # best effort: the original error is the one to report
                await self._close()
            raise
        await self._close()
        await self._flush()
        await self.buffer.put_ack(Ack(self.rank, Phase.STOPPED, stats=self.stats(),
                                      events=self.proxy.take_events()))
        return self.stats()

    async def _loop(self):
        while True:
            if self.error is not None:
                raise RuntimeError(f"rollout rank {self.rank}: a trajectory crashed: "
                                   f"{self.error!r}") from self.error
            if self.sync_task is not None and self.sync_task.done():
                task, self.sync_task = self.sync_task, None
                task.result()      # a failed sync ends the rank, as it did when awaited here
            # (a sync that sees the engine fail recovers it itself; after it, what is left is ours)
            if self.recovery is not None and self.sync_task is None:
                await self.recovery.recover_pending(self)
            # during a sync, tasks start only while the engine is suspended (they generate after the
            # resume: see _handle), and not while it replaces a dead engine (they would fail with it)
            may_start = (self.sync_task is None or (self.proxy.status == Status.SUSPENDED and not
                                                    (self.recovery is not None and self.recovery.busy)))
            # one round trip: the finished samples out; in, the next command (one at a time, in order:
            # the next waits for the sync in flight) and, with free slots and none held, tasks for them
            samples, self.outbox = self.outbox, []
            want = self.slots.free() if may_start and not self.held else 0
            cmd, tasks, queued = await self.buffer.exchange(self.rank, samples, self.sync_task is None, want)
            self.held.extend(tasks)
            if cmd is not None:
                if await self._handle(cmd):
                    return
                continue
            if may_start:          # (tasks queued after the exchange wait for the next tick)
                await self._pull_tasks(budget=queued - len(tasks))
            self.wake.clear()
            # sleep one poll period, or less when a slot frees. (Not asyncio.wait_for: in Python 3.11 a
            # cancel that lands as the event fires is swallowed, and a cancelled rank ran on for ever)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.poll_s):
                    await self.wake.wait()

    async def _close(self):
        if self.sync_task is not None:    # the loop failed or was cancelled during a sync: end it first
            task, self.sync_task = self.sync_task, None
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=self.cfg.stop_timeout_s)
            if not done:
                raise TimeoutError(f"rollout rank {self.rank}: the weight sync did not end within "
                                   f"{self.cfg.stop_timeout_s:.0f}s of its cancellation, during stop")
            if not task.cancelled():
                task.exception()  # (retrieved, not raised: the loop's own error is the one to report)
        await self._abort(list(self.jobs), "aborted_at_stop")
        if self.scorer is not None:
            self.scorer.shutdown()

    async def _handle(self, cmd: Command) -> bool:
        """Run one command; True means stop."""
        if cmd.kind == Cmd.STOP:
            return True
        if cmd.kind == Cmd.SYNC:        # beside the loop: it goes on sending samples and starting tasks
            # Only the work running now can hold tokens older than the new version: the loop starts
            # tasks during the sync only while the engine is suspended, so they generate after the
            # resume (their trajectories' start version, the old one, would look stale)
            running = set(self.jobs)
            self.sync_task = asyncio.get_running_loop().create_task(self._timed_sync(cmd, running),
                                                                    name=f"rank{self.rank}:sync")
            self.sync_task.add_done_callback(lambda _: self.wake.set())     # the loop reports its end
        elif cmd.kind == Cmd.SLEEP:          # colocated: the trainer needs this GPU's memory now
            await self._abort(list(self.jobs), "aborted_by_request", notice=Lost.INTERRUPTED)
            await self._flush()    # (the notices: the controller re-admits what the sleep ended)
            await self.proxy.sleep()
            await self.buffer.put_ack(Ack(self.rank, Phase.SLEPT))
        elif cmd.kind == Cmd.ABORT_GROUPS:
            groups = set(cmd.group_ids)
            self.aborted_groups |= groups
            await self._abort([tid for tid, (task, _) in self.jobs.items() if task.group_id in groups],
                              "aborted_by_request")
        else:
            raise ValueError(f"rollout rank {self.rank}: unknown command {cmd!r}")
        return False

    async def _timed_sync(self, cmd: Command, running: set[str]):
        try:
            async with asyncio.timeout(self.sync_timeout_s) as limit:
                await self._sync(cmd, running)
        except TimeoutError:
            if not limit.expired():     # (a timeout of its own, inside the sync: reported as it is)
                raise
            raise TimeoutError(f"rollout rank {self.rank}: weight sync to version {cmd.version} "
                               f"took longer than {self.sync_timeout_s:.0f}s") from None

    async def _sync(self, cmd: Command, running: set[str]):
        """The rollout side of a weight update (module docstring); the controller waits for its ack.
        Only the tasks in `running` can be stale (see _handle).
        A failed broadcast ends the rank, or with a recovery (ext/recovery.py): SYNCED says needs_weights,
        and the engine (a new one if it died, acked REPLACED) waits suspended for the controller's next
        SYNC."""
        v, t0 = cmd.version, now()
        first_rank = 1 + self.rank * (cmd.spec.workers_per_engine if cmd.spec else 1)
        probe, t1 = None, t0
        if cmd.spec is not None and self.recovery is not None and not self.recovery.may_join(cmd.spec.gen):
            return await self._ack_synced(v, {"receive_s": 0.0, "load_s": 0.0}, needs_weights=True)
        try:
            await self.proxy.suspend(self.cfg.suspend_mode)
            t1 = now()
            workers = await self.proxy.update_weights(cmd.layout or [], v, cmd.spec, first_rank)
            t2 = now()
            await self.proxy.resume()
            self.synced = True
            rule = self.freshness = cmd.freshness or self.freshness
            stale = [tid for tid, (task, _) in self.jobs.items() if tid in running and rule is not None
                     and task.eval_temperature is None                      # (evaluation is never trained)
                     and not rule.fresh(self._oldest_version(tid), v, task.group_id)]
            await self._abort(stale, "aborted_stale", notice=Lost.STALE)
            probe = await self.proxy.score(self.probe_ids) if cmd.probe and self.probe_ids else None
        except EngineError as e:
            if self.recovery is None:
                raise
            return await self.recovery.sync_failed(self, e, v, t0, t1)
        vllm_load = max((w["total_s"] - w["wait_s"] for w in workers or []), default=0.0)   # (the fake: none)
        await self._ack_synced(v, {"receive_s": t2 - t1, "load_s": now() - t0, "vllm_load_s": vllm_load},
                               probe=probe)

    async def _ack_synced(self, version: int, timings: dict, **fields):
        await self.buffer.put_ack(Ack(self.rank, Phase.SYNCED, version,
                                      engine={**self.proxy.stats(), **self.reward_stats()},
                                      timings=timings, events=self.proxy.take_events(), **fields))

    async def _pull_tasks(self, budget: int):
        """Start tasks while there are free slots, at most one task of a group per poll period when
        other ranks pull too (module docstring). The held tasks first (the loop's exchange fetched up to
        as many as there were free slots), then one round trip fetches more when they are used up; it
        looks at each task queued at the exchange at most once (budget: those not fetched yet), and the
        tasks it passes over go back to the queue's front, in order, in one more round trip. Never waits for a
        task (the queue is polled)."""
        t_now = now()
        spread = self.num_ranks > 1
        if len(self.group_taken_at) > 4 * self.cfg.max_concurrency:   # forget groups older than a period
            self.group_taken_at = {g: at for g, at in self.group_taken_at.items()
                                   if t_now - at < self.cfg.poll_s}
        passed_over = []
        try:
            while self.slots.free() > 0:
                if not self.held:
                    want = min(self.slots.free(), budget)
                    got = await self.buffer.poll_tasks(want) if want > 0 else []
                    if not got:
                        return
                    budget -= len(got)
                    self.held.extend(got)
                task = self.held[0]
                if task.group_id in self.aborted_groups:
                    self.held.popleft()
                    self.counters["tasks_skipped"] += 1
                    continue
                if task.num_samples > self.cfg.max_concurrency:
                    raise ValueError(f"rollout rank {self.rank}: task {task.task_id} has "
                                     f"num_samples={task.num_samples} > "
                                     f"max_concurrency={self.cfg.max_concurrency}; it could never start")
                # (a period is poll_s less a float's rounding: the next timed poll is exactly poll_s later)
                if (spread and t_now - self.group_taken_at.get(task.group_id, -math.inf)
                        < 0.999 * self.cfg.poll_s):
                    # another rank with room takes it within a period
                    passed_over.append(self.held.popleft())
                    continue
                if task.num_samples > self.slots.free():
                    return             # held until enough slots free
                self.group_taken_at[task.group_id] = t_now
                self._start(self.held.popleft())
        finally:
            if passed_over:
                await self.buffer.return_tasks(passed_over)

    def _start(self, task: RolloutTask):
        self.slots.take(task.task_id, task.num_samples)
        self.counters["tasks_started"] += 1
        self.trajs[task.task_id] = {}
        job = asyncio.get_running_loop().create_task(self._run_task(task),
                                                     name=f"rank{self.rank}:{task.task_id}")
        self.jobs[task.task_id] = (task, job)
        job.add_done_callback(lambda j, task=task: self._on_done(task, j))

    def _on_done(self, task: RolloutTask, job: asyncio.Task):
        """Free the slots whatever happened (done, failed, aborted: the control loop wakes); remember a
        crash for run()."""
        self.slots.give(task.task_id)
        self.jobs.pop(task.task_id, None)
        self.trajs.pop(task.task_id, None)
        exc = None if job.cancelled() else job.exception()
        if isinstance(exc, EngineError) and self.recovery is not None:
            self.recovery.lose(task, exc)     # the engine died under it: recovered by the control loop
        elif isinstance(exc, Exception) and not isinstance(exc, Aborted) and self.error is None:
            self.error = exc

    def _oldest_version(self, task_id: str) -> int:
        trajs = self.trajs.get(task_id, {})
        return min((tr.oldest_version for tr in trajs.values()), default=self.proxy.version)

    def _give_up(self, task: RolloutTask, error: str, **meta):
        """Tell the controller that the task's samples will never come: one failed sample per sample, not
        retried, so that its group is resolved (buffer.GroupAssembler.add) and frees its admission place."""
        for i in range(task.num_samples):
            self._enqueue(Sample(task.task_id, task.group_id, [], [], [], [], [], 0.0, finish_reason="failed",
                                 rank=self.rank, admit_version=task.admit_version, failed=True,
                                 meta={"error": error, "retrying": False, "sample_index": i, "timeout": False,
                                       "eval": task.eval_temperature is not None, **meta}))

    async def _abort(self, task_ids: list[str], counter: str | None, notice: Lost | None = None):
        """End these tasks: abort their engine requests first (so the engine drops them), then
        cancel their loops and wait for them to unwind. No sample is sent for them, unless `notice`
        (an abort of the rank's own, which the controller did not ask for) sends one per sample saying
        why."""
        jobs = [self.jobs[tid] for tid in task_ids if tid in self.jobs]
        if not jobs:
            return
        trajs = [tr for task, _ in jobs for tr in self.trajs.get(task.task_id, {}).values()]
        rids = [tr.request_id for tr in trajs if tr.request_id]
        # thrown away: the model tokens of their finished turns and of the turn in flight
        self.counters["tokens_aborted"] += sum(sum(tr.loss_mask) for tr in trajs) + sum(
            self.proxy.tokens_so_far(rid) for rid in rids)
        for task, job in jobs:
            job.cancel()           # request before any await: the job cannot send a sample after this
            if counter:
                self.counters[counter] += task.num_samples
            if notice:
                self._give_up(task, f"aborted by rollout rank {self.rank} ({notice})", aborted=str(notice))
        if rids and self.proxy.status != Status.STOPPED:
            await self.proxy.abort(rids)
        done, pending = await asyncio.wait([j for _, j in jobs], timeout=self.cfg.stop_timeout_s)
        if pending:
            raise TimeoutError(f"rollout rank {self.rank}: {len(pending)} aborted trajectories did not end "
                               f"within {self.cfg.stop_timeout_s:.0f}s during abort")

    # --- one task: one trajectory, or n of them with a group barrier (batch baseline)

    async def _run_task(self, task: RolloutTask):
        live = self.trajs[task.task_id]     # index -> the attempt running now, for aborts and staleness
        # the sample's slot is free while a finisher completes it (Slots says why); the controller's
        # admission still bounds the samples in flight
        finish = functools.partial(self.slots.lend, task.task_id, self.finisher) if self.finisher else None

        def one(i):
            return run_trajectory(self.proxy, lambda: self._make_env(task), self.fmt, self.cfg, task, i,
                                  on_attempt=live.__setitem__, on_failure=self._report_failure,
                                  deadline=self.deadline, finish=finish)
        await self._back_off()
        if task.num_samples == 1:  # replicated tasks: the common case, no sub-tasks
            samples = [await one(0)]
        else:
            subs = [asyncio.ensure_future(one(i)) for i in range(task.num_samples)]
            try:
                samples = await asyncio.gather(*subs)
            finally:
                for s in subs:     # on abort or crash, siblings end too
                    s.cancel()
        for s in samples:          # num_samples > 1: all n together, on purpose (the baseline's barrier)
            if s is not None:
                self._enqueue(s)
                self.counters["samples_sent"] += 1
                self.fail_streak = 0

    def _enqueue(self, s: Sample):
        self.outbox.append(s)
        self.wake.set()            # the control loop flushes the outbox at once

    async def _flush(self):
        if self.outbox:
            out, self.outbox = self.outbox, []
            await self.buffer.put_samples(out)

    async def _report_failure(self, s: Sample):
        self.counters["samples_failed"] += 1
        self.counters["env_timeouts"] += s.meta["timeout"]
        self.counters["retries"] += s.meta["retrying"]
        self._enqueue(s)
        self.fail_streak += 1
        if s.meta["retrying"]:
            await self._back_off()

    async def _back_off(self):
        """Before an attempt on a rank whose last attempts failed: wait, longer after each failure in a row
        (a success resets it), so that a failure every sample meets does not spin hot (the controller's
        breaker then ends the run: controller.FailureBreaker)."""
        if self.fail_streak:
            await asyncio.sleep(min(BACKOFF_S[0] * 2 ** min(self.fail_streak - 1, 16), BACKOFF_S[1]))

    def _make_env(self, task: RolloutTask):
        if (name := task.env or task.problem.env) not in ENVS:      # (the task's, else its problem's)
            raise ValueError(f"rollout rank {self.rank}: task {task.task_id} asks for env {name!r}; "
                             f"known: {sorted(ENVS)}")
        held_out = task.eval_temperature is not None
        env = ENVS[name](task.problem, env_seed(task.group_id),
                             reward_fn=self.eval_reward_fn if held_out else self.reward_fn)
        return self.env_wrappers(env) if self.env_wrappers else env


def for_rank(cfg, exts, proxy, buffer, tokenizer, index: int, restart_engine=None) -> "EnvManager":
    """A rollout rank's EnvManager over its proxy, with what the extensions bring: a dead engine's
    replacement (given restart_engine), env faults, a verifier pool, an adaptive env deadline."""
    wrappers = exts.call("env_wrapper", index)          # (injected faults)
    return EnvManager(proxy, buffer, tokenizer, index, cfg.rollout, sync_timeout_s=cfg.controller.timeout_s,
                      probe_ids=tokenizer.encode(PROBE_TEXT),
                      recovery=exts.first("engine_recovery", restart_engine) if restart_engine else None,
                      env_wrappers=functools.reduce(lambda f, g: lambda env: g(f(env)), wrappers)
                      if wrappers else None, scorer=exts.first("scorer", index, buffer),
                      deadline=exts.first("env_deadline"),
                      finisher=exts.chain("sample_finisher", index, buffer))   # (a teacher's log-probs, ...)
