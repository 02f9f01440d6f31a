"""EnvManager and envs on the timed fake engine, in fast-forwarded virtual time (looptime).

Arrival times below are virtual seconds: the fake engine's decode step is STEP seconds for the whole
batch (k=0), so a request of n tokens ends at about n * STEP after it starts."""

import asyncio
import itertools
import math
import random

import pytest

from buffer import (Ack, Cmd, Command, GroupAssembler, LocalQueues, Lost, Phase, RolloutTask, Sample,
                    SampleBuffer)
from env_manager import EnvManager, RolloutConfig, env_seed
from ext.deadlines import MIN_SAMPLES, WINDOW, DeadlineConfig, EnvDeadline
from ext.verifiers import RewardPool, VerifierConfig
from rollout import ENVS, SingleTurnEnv
from ext.games import ChainEnv, GuessEnv
import ext.longtail  # noqa: F401  (a task with a target_len answers in exactly that many tokens, EOS ignored)
from ext.faults import EnvFault, FaultyEnv, LatencyEnv
from ext.recovery import EngineRecovery, SyncRecovery
from tools.fake_engine import FakeTimedEngine
from proxy import EngineError, LLMProxy, Status
from conftest import run_virtual
from ext.colocate import sleep_engines
from ext.eval import Evaluation
from task import Problem

pytestmark = pytest.mark.fast

STEP = 0.1   # fake decode step, virtual seconds


def now() -> float:
    return asyncio.get_running_loop().time()


@pytest.fixture(scope="module")
def tok():
    from tiny_model import build_tokenizer
    return build_tokenizer()


def rcfg(**kw) -> RolloutConfig:
    """The rollout settings these tests run with (8 tokens a turn, a 120-token context), then kw."""
    return RolloutConfig(**{"max_tokens": 8, "max_model_len": 120, **kw})


def adaptive(cfg=None, reward_s: float = VerifierConfig.reward_timeout_s, **kw) -> EnvDeadline:
    """The env deadline a run's rollout rank has by default (ext/deadlines.py), with DeadlineConfig's kw."""
    return EnvDeadline.of(cfg or rcfg(), DeadlineConfig(**kw), reward_s)


def make_manager(buf, tok, rank=0, cfg=None, env_wrappers=None, probe_ids=None, freshness=1, deadline=None,
                 scorer=None, **engine_kwargs):
    engine_kwargs = {"t0": STEP, "k": 0.0, **engine_kwargs}
    proxy = LLMProxy(FakeTimedEngine(seed=rank, **engine_kwargs), rank=rank, timeout_s=30.0)
    return EnvManager(proxy, buf, tok, rank, cfg or rcfg(), freshness=freshness,
                      env_wrappers=env_wrappers, probe_ids=probe_ids, deadline=deadline or adaptive(cfg),
                      scorer=scorer)


def add_task(task_id, group_id="g", target_len=0, num_samples=1, env="", prompt="1+1=", answer="2"):
    return RolloutTask(task_id, group_id, Problem(prompt, answer, target_len=target_len),
                       num_samples=num_samples, env=env)


async def collect(buf, n, timeout=10_000.0):
    """The next n samples with their virtual arrival times."""
    out = []
    for _ in range(n):
        s = await buf.get_sample(timeout=timeout)
        out.append((now(), s))
    return out


async def stop_all(buf, managers, runs):
    for m in managers:
        await buf.send_command(m.rank, Command(Cmd.STOP))
    stats = await asyncio.wait_for(asyncio.gather(*runs), 60)
    acks = buf.transport.get_many_nowait("acks", 1000)
    stopped = [a for a in acks if a.phase == Phase.STOPPED]
    assert sorted(a.rank for a in stopped) == sorted(m.rank for m in managers)
    assert all(a.phase in (Phase.READY, Phase.SYNCED) for a in acks if a not in stopped)
    return stats


def run_one_task(tok, task, **manager_kwargs):
    """One EnvManager, one task: its sample, in virtual time."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, **manager_kwargs)
        await buf.put_tasks([task])
        run = asyncio.create_task(m.run())
        [(_, s)] = await collect(buf, 1)
        await stop_all(buf, [m], [run])
        return s
    return run_virtual(main())


def script(tok, text):
    """A fake-engine `respond` that always answers `text` then EOS."""
    return lambda prompt_ids: tok.encode(text) + [tok.eos_token_id]


# ---------------------------------------------------------------------------------------------
# scheduling


def test_queue_scheduling_short_samples_do_not_wait_for_long(tok):
    """One 1000-token request and four short ones on one rank: each short sample reaches the
    buffer at its own finish time, long before the long one."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000))
        await buf.put_tasks([add_task("long", "gl", target_len=1000)])
        for n in (5, 10, 15, 20):
            await buf.put_tasks([add_task(f"short{n}", f"g{n}", target_len=n)])
        run = asyncio.create_task(m.run())
        got = await collect(buf, 5)
        await stop_all(buf, [m], [run])
        return got
    got = run_virtual(main())
    order = [s.task_id for _, s in got]
    assert order == ["short5", "short10", "short15", "short20", "long"]
    for t, s in got:
        n = len(s.response_ids)
        assert n == (1000 if s.task_id == "long" else int(s.task_id[5:]))
        assert t == pytest.approx(n * STEP, abs=2 * STEP)      # arrived when it finished, not later
        assert s.finish_reason == "length" and s.loss_mask == [1] * n and len(s.versions) == n


def test_replication_spreads_group_over_ranks_and_batch_task_arrives_together(tok):
    async def main():
        buf = SampleBuffer(LocalQueues(2), "test")
        lengths = lambda: (lambda rng, it=itertools.cycle(range(1, 9)): next(it))   # 1..8 tokens, in turn
        cfg = rcfg(max_concurrency=4)
        ms = [make_manager(buf, tok, rank=r, cfg=cfg, length_sampler=lengths()) for r in range(2)]
        runs = [asyncio.create_task(m.run()) for m in ms]
        for i in range(8):                                   # replicated: 8 tasks of one group
            await buf.put_tasks([add_task(f"rep{i}", "rep")])
        replicated = await collect(buf, 8)
        await buf.put_tasks([add_task("batch", "batch", num_samples=4)])   # baseline: one task, 4 samples
        t0 = now()
        batch = await collect(buf, 4)
        stats = await stop_all(buf, ms, runs)
        return replicated, batch, t0, stats
    replicated, batch, t0, stats = run_virtual(main())
    assert {s.rank for _, s in replicated} == {0, 1}
    assert len({t for t, _ in replicated}) > 1             # each sample when it is done
    assert len({s.rank for _, s in batch}) == 1
    assert len({t for t, _ in batch}) == 1                 # all together (the group barrier) ...
    lens = sorted(len(s.response_ids) for _, s in batch)
    assert lens[0] < lens[-1]
    assert batch[0][0] - t0 >= lens[-1] * STEP             # ... when the longest one ended
    assert sum(st["samples_sent"] for st in stats) == 12 and all(st["in_flight"] == 0 for st in stats)


def test_max_concurrency_bounds_in_flight_work(tok):
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_concurrency=3), length_sampler=lambda rng: 8)
        for i in range(9):
            await buf.put_tasks([add_task(f"t{i}", f"g{i}")])
        run = asyncio.create_task(m.run())
        await asyncio.sleep(STEP / 2)
        in_flight = m.stats()["in_flight"], m.proxy.num_in_flight
        got = await collect(buf, 9)
        await stop_all(buf, [m], [run])
        return in_flight, got
    in_flight, got = run_virtual(main())
    assert in_flight == (3, 3)
    # three waves of three 8-token requests
    assert [round(t / (8 * STEP)) for t, _ in got] == [1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_a_sample_frees_its_slot_while_its_finisher_waits(tok):
    """A finisher that takes 10 s (a teacher's log-probs) does not hold the generation slot: three slots
    generate nine 8-token samples in three waves of 0.8 s, and each arrives 10 s after its wave, not
    after the waves before it have finished too. A finisher that fails takes its slot back for the retry,
    and every slot is free at the end."""
    from rollout import EnvFailure
    failed_once = set()

    async def finisher(sample):
        await asyncio.sleep(10.0)
        if sample.task_id == "t4" and "t4" not in failed_once:
            failed_once.add("t4")
            raise EnvFailure("the teacher failed it")

    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_concurrency=3), length_sampler=lambda rng: 8)
        m.finisher = finisher
        for i in range(9):
            await buf.put_tasks([add_task(f"t{i}", f"g{i}")])
        run = asyncio.create_task(m.run())
        got = [(t, s) for t, s in await collect(buf, 10)]
        in_flight = m.stats()["in_flight"]
        await stop_all(buf, [m], [run])
        return got, in_flight
    got, in_flight = run_virtual(main())
    ok = [(t, s.task_id) for t, s in got if not s.failed]
    assert [s.task_id for _, s in got if s.failed] == ["t4"]
    waves = {tid: round(t - 10.0, 1) for t, tid in ok}
    assert sorted(v for k, v in waves.items() if k != "t4") == [0.8] * 3 + [1.6] * 2 + [2.4] * 3
    assert waves["t4"] > 10.0          # its second attempt generated after the first one's finisher failed
    assert in_flight == 0 and len(ok) == 9


def test_a_finisher_that_fails_while_the_rank_is_full_waits_for_a_free_slot(tok):
    """Two slots; every sample's finisher takes 1 s, and t0's fails once. When it fails (t = 1.8) both slots
    generate t4 and t5, so its retry waits for one of them (t = 2.4) instead of taking a third: the rank never
    runs more than --max-concurrency samples, and the engine never holds more requests."""
    from rollout import EnvFailure
    failed_once, most = set(), [0, 0]

    async def finisher(sample):
        await asyncio.sleep(1.0)
        if sample.task_id == "t0" and "t0" not in failed_once:
            failed_once.add("t0")
            raise EnvFailure("the teacher failed it")

    async def watch(m):
        while True:
            most[0] = max(most[0], m.stats()["in_flight"])
            most[1] = max(most[1], m.proxy.num_in_flight)
            await asyncio.sleep(0.01)

    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_concurrency=2), length_sampler=lambda rng: 8)
        m.finisher = finisher
        for i in range(8):
            await buf.put_tasks([add_task(f"t{i}", f"g{i}")])
        run = asyncio.create_task(m.run())
        watcher = asyncio.create_task(watch(m))
        got = await collect(buf, 9)
        watcher.cancel()
        in_flight = m.stats()["in_flight"]
        await stop_all(buf, [m], [run])
        return got, in_flight
    got, in_flight = run_virtual(main())
    assert most == [2, 2], f"the rank ran {most[0]} samples and its engine {most[1]} requests with 2 slots"
    retried = [t for t, s in got if s.task_id == "t0" and not s.failed]
    assert len(retried) == 1 and retried[0] >= 2.4 + 0.8 + 1.0 - 1e-6   # a free slot, generation, finisher
    assert in_flight == 0 and sum(not s.failed for _, s in got) == 8


def test_idle_ranks_share_a_group_at_default_concurrency(tok):
    """Low load, default max_concurrency (64 free slots per rank): a replicated group of 8 spreads
    over all 4 engines, 2 samples each, instead of the first rank to poll taking all 8. A greedy
    single rank (num_ranks=1) still takes the whole group in one poll."""
    async def main(num_ranks):
        buf = SampleBuffer(LocalQueues(num_ranks), "test")
        cfg = rcfg()
        assert cfg.max_concurrency >= 8
        ms = [make_manager(buf, tok, rank=r, cfg=cfg, length_sampler=lambda rng: 20)
              for r in range(num_ranks)]
        runs = [asyncio.create_task(m.run()) for m in ms]
        await asyncio.sleep(cfg.poll_s / 2)                  # every rank idle and polling
        for i in range(8):
            await buf.put_tasks([add_task(f"g.{i}", "g")])
        got = await collect(buf, 8)
        await stop_all(buf, ms, runs)
        return [s.rank for _, s in got], [t for t, _ in got]
    ranks, times = run_virtual(main(4))
    assert sorted(ranks) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert max(times) < 20 * STEP + 3 * rcfg().poll_s + 2 * STEP    # spread within two poll periods
    ranks, _ = run_virtual(main(1))
    assert ranks == [0] * 8


def test_tasks_a_rank_passes_over_go_back_to_the_front_of_the_queue(tok):
    """Rank 0 of two, 2 free slots; queued: a.0, a.1, b.0, c.0. It starts a.0, passes over a.1 (one task of
    a group per poll period: the other rank takes it), starts b.0 and puts a.1 back at the queue's front, so
    that a's second sample starts next, close to its first, not after every task queued behind it."""
    async def main():
        buf = SampleBuffer(LocalQueues(2), "test")
        m = make_manager(buf, tok, rank=0, cfg=rcfg(max_concurrency=2), length_sampler=lambda rng: 20)
        await buf.put_tasks([add_task("a.0", "a"), add_task("a.1", "a"), add_task("b.0", "b"),
                             add_task("c.0", "c")])
        await m._pull_tasks(budget=4)
        started, left = sorted(m.jobs), [t.task_id for t in buf.transport.get_many_nowait("tasks", 10)]
        await m._abort(list(m.jobs), None)
        return started, left
    started, left = run_virtual(main())
    assert started == ["a.0", "b.0"] and left == ["a.1", "c.0"]


def test_a_rank_takes_the_rest_of_a_group_when_the_others_are_full(tok):
    """Rank 1 is full (max_concurrency 1, busy with a long task): rank 0 takes the whole group,
    one more sample per poll period, and nothing waits for rank 1."""
    async def main():
        buf = SampleBuffer(LocalQueues(2), "test")
        m0 = make_manager(buf, tok, rank=0, cfg=rcfg(), length_sampler=lambda rng: 20)
        m1 = make_manager(buf, tok, rank=1, cfg=rcfg(max_concurrency=1, max_model_len=2000))
        runs = [asyncio.create_task(m1.run())]
        await buf.put_tasks([add_task("long", "long", target_len=1000)])
        await asyncio.sleep(1.0)                              # rank 1 took the long task: it is full
        runs.append(asyncio.create_task(m0.run()))
        t0 = now()
        for i in range(4):
            await buf.put_tasks([add_task(f"g.{i}", "g")])
        got = await collect(buf, 4)
        await stop_all(buf, [m0, m1], runs)
        return t0, got
    t0, got = run_virtual(main())
    assert {s.rank for _, s in got} == {0}
    assert max(t for t, _ in got) - t0 < 20 * STEP + 5 * rcfg().poll_s + 2 * STEP   # long before 100 s

# ---------------------------------------------------------------------------------------------
# rewards, EOS, filtering


def test_reward_excludes_eos_and_equal_reward_group_is_filtered(tok):
    """Scripted answers: group "all" always right (rewards all 1: no GRPO signal, filtered),
    group "mixed" right every other time (kept). EOS is trained on (mask 1) but not in the text."""
    answers = itertools.cycle(["2", "3"])

    def respond(prompt_ids):
        text = tok.decode(prompt_ids)
        return tok.encode("4" if text == "2+2=" else next(answers)) + [tok.eos_token_id]

    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, respond=respond)
        for i in range(4):
            await buf.put_tasks([add_task(f"a{i}", "all", prompt="2+2=", answer="4")])
            await buf.put_tasks([add_task(f"m{i}", "mixed", prompt="1+1=", answer="2")])
        run = asyncio.create_task(m.run())
        got = [s for _, s in await collect(buf, 8)]
        await stop_all(buf, [m], [run])
        return got
    samples = run_virtual(main())
    for s in samples:
        assert s.response_ids[-1] == tok.eos_token_id and s.loss_mask == [1, 1] and s.finish_reason == "stop"
    assert sorted(s.reward for s in samples if s.group_id == "mixed") == [0.0, 0.0, 1.0, 1.0]
    ga = GroupAssembler(group_size=4, freshness=1)
    for s in samples:
        ga.add(s, version=0)
    assert ga.groups_filtered == 1 and ga.num_ready() == 1          # "all" filtered, "mixed" kept
    [group] = ga.take(8, version=0)
    assert {s.group_id for s in group} == {"mixed"}


def test_a_length_budget_scores_the_answer_up_to_eos_and_keeps_the_rest_out_of_the_loss(tok):
    """--response-len-median (target_len, EOS ignored): the engine generates past EOS; the verifier sees
    the answer up to its first EOS, and the tokens after it stay in the sample, out of the loss."""
    tail = tok.encode("77")
    s = run_one_task(tok, add_task("t", target_len=3 + len(tail)),
                     respond=lambda ids: tok.encode("2") + [tok.eos_token_id] + tail)
    assert s.reward == 1.0 and len(s.response_ids) == 2 + len(tail)
    assert s.loss_mask == [1, 1] + [0] * len(tail) and len(s.versions) == 2


def _sample(gid, reward, version=0, failed=False):
    return Sample("t", gid, [1], [2], [-1.0], [1], [version], reward, failed=failed)


def test_group_assembler_surplus_failed_and_stale():
    ga = GroupAssembler(group_size=2, freshness=1)
    ga.add(_sample("a", 1.0), 0)
    ga.add(_sample("a", 0.0, failed=True), 0)           # failed: counted, not part of the group
    ga.add(_sample("a", 0.0), 0)                        # completes "a"
    ga.add(_sample("a", 1.0), 0)                        # redundant rollout: surplus
    ga.add(_sample("b", 1.0, version=0), 1)
    assert ga.samples_failed == 1 and ga.samples_surplus == 1 and ga.num_ready() == 1
    assert ga.evict_stale(version=2) == ["b", "a"]      # version 0 < 2 - 1: both can never train
    assert ga.take(4, version=2) == [] and ga.samples_dropped_stale == 3
    ga.add(_sample("b", 0.0, version=2), 2)             # late sample of a dead group
    assert ga.samples_dropped_stale == 4


# ---------------------------------------------------------------------------------------------
# failures


def test_hung_env_fails_and_is_replaced_within_timeout(tok):
    """The first env built hangs on reset; it fails at the timeout, a failed Sample reports it,
    a fresh env replaces it, and the other task is not held up."""
    built = itertools.count()

    def wrap(env):
        return FaultyEnv(env, 0.0, 1.0, random.Random(0)) if next(built) == 0 else env

    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        cfg = rcfg(env_step_timeout_s=5.0)
        m = make_manager(buf, tok, cfg=cfg, env_wrappers=wrap, length_sampler=lambda rng: 4)
        await buf.put_tasks([add_task("hangs", "g1")])
        await buf.put_tasks([add_task("fine", "g2")])
        run = asyncio.create_task(m.run())
        got = await collect(buf, 3)
        [stats] = await stop_all(buf, [m], [run])
        return got, stats
    got, stats = run_virtual(main())
    (t1, s1), (t2, s2), (t3, s3) = got
    assert s1.task_id == "fine" and not s1.failed and t1 == pytest.approx(4 * STEP, abs=STEP)
    assert s2.task_id == "hangs" and s2.failed and s2.meta["retrying"] and t2 == pytest.approx(5.0, abs=STEP)
    assert "5s" in s2.meta["error"] and "rank 0" in s2.meta["error"]
    assert s3.task_id == "hangs" and not s3.failed and t3 == pytest.approx(5.0 + 4 * STEP, abs=2 * STEP)
    assert (stats["samples_failed"], stats["env_timeouts"], stats["retries"],
            stats["samples_sent"]) == (1, 1, 1, 2)


def test_env_failing_every_time_gives_up_after_max_retries(tok):
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        rng = random.Random(0)
        cfg = rcfg(max_retries=2)
        m = make_manager(buf, tok, cfg=cfg, length_sampler=lambda rng: 3,
                         env_wrappers=lambda env: env if isinstance(env, GuessEnv)
                         else FaultyEnv(env, 1.0, 0.0, rng))
        await buf.put_tasks([add_task("bad", "g1")])
        run = asyncio.create_task(m.run())
        bad = [s for _, s in await collect(buf, 3)]
        await buf.put_tasks([add_task("after", "g2", env="guess")])   # the rank goes on
        [(_, after)] = await collect(buf, 1)
        [stats] = await stop_all(buf, [m], [run])
        return bad, after, stats
    bad, after, stats = run_virtual(main())
    assert all(s.failed and "injected" in s.meta["error"] for s in bad)
    assert [s.meta["retrying"] for s in bad] == [True, True, False]
    assert not after.failed and after.task_id == "after"
    assert (stats["samples_failed"], stats["retries"], stats["env_timeouts"]) == (3, 2, 0)


def test_a_failure_every_sample_meets_backs_off_and_stops_the_run_naming_it(tok):
    """An env whose reset always fails: the rank waits longer after each failure in a row instead of retrying
    and re-admitting hot, and once (nearly) every sample of the breaker's window failed, collect raises,
    naming the reason with its count and the flag; nothing is trained."""
    from controller import AsyncController, ControllerConfig
    from env_manager import BACKOFF_S

    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        ctrl = AsyncController(ControllerConfig(batch_groups=2, group_size=2, async_ratio=0, redundant=0,
                                                filter_groups=False), buf,
                               (Problem("1+1=", "2") for _ in itertools.count()), 1)
        m = make_manager(buf, tok, cfg=rcfg(max_concurrency=4, max_retries=1),
                         env_wrappers=lambda env: FaultyEnv(env, 1.0, 0.0, random.Random(0)))
        run = asyncio.create_task(m.run())
        await ctrl.wait_ready()
        t0 = now()
        try:
            with pytest.raises(RuntimeError) as e:
                await ctrl.collect()
            return str(e.value), now() - t0, ctrl.breaker
        finally:
            await ctrl.stop()
            await run
    message, elapsed, breaker = run_virtual(main())
    assert "64 of the last 64 samples failed" in message and "--max-failed-share 0.95" in message
    assert "64 x rollout rank 0: env 'single-turn' reset (task g" in message and "injected" in message
    # 64 failures on 4 slots: 16 a slot, each waiting BACKOFF_S[0] x 2 ** (failures in a row), at most
    # BACKOFF_S[1]: most of them wait the most; hot, they took no time at all
    assert elapsed > 8 * BACKOFF_S[1], f"64 failures in {elapsed:.1f} virtual seconds: no back-off"


def test_the_breaker_counts_a_window_and_trips_only_past_its_share():
    """The window slides: failures mixed with successes do not trip it, 95% of it failing does, and a rank's
    notices (its own aborts) and evaluation samples are not counted."""
    from controller import FailureBreaker
    ok, bad = _sample("g", 1.0), _sample("g", 0.0, failed=True)
    bad.meta["error"] = "rollout rank 3: task g17.2: the judge's context (128) is too short"
    notice = _sample("g", 0.0, failed=True)
    notice.meta["aborted"] = "dropped_stale"
    b = FailureBreaker(20, 0.95)
    for _ in range(100):
        b.add(notice, "test")               # never counted
    for i in range(200):
        b.add(ok if i % 10 == 0 else bad, "test")    # 90% failed: runs on
    b = FailureBreaker(20, 0.95)
    b.add(ok, "test")
    for _ in range(18):
        b.add(bad, "test")                  # 18 of 19: the window is not full yet
    with pytest.raises(RuntimeError, match=r"19 of the last 20 samples failed .* 19 x rollout rank 3: task "
                                           r"g17\.2: the judge's context \(128\)"):
        b.add(bad, "test")


# ---------------------------------------------------------------------------------------------
# the adaptive env deadline


def test_env_deadline_quantile_times_factor_within_floor_and_ceiling():
    d = EnvDeadline(30.0, quantile=0.9, factor=3.0, floor_s=1.0)
    for i in range(MIN_SAMPLES - 1):                          # too few: the ceiling
        d.record("step", 0.5)
    assert d.current_s == {"reset": 30.0, "step": 30.0}
    d.record("step", 0.5)
    assert d.current_s == {"reset": 30.0, "step": 1.5}      # 0.5 x 3; resets have a window of their own
    for _ in range(WINDOW):                                    # the window forgets: only the latest count
        d.record("step", 0.1)
    assert d.current_s["step"] == 1.0                          # 0.3: the floor
    for _ in range(WINDOW):
        d.record("step", 20.0)
    assert d.current_s["step"] == 30.0                         # 60: the ceiling
    q = EnvDeadline(30.0, quantile=0.9, factor=3.0, floor_s=1.0)
    for x in range(1, 201):                                    # 0.01 .. 2.00 s: the 0.9-quantile is 1.8
        q.record("step", x / 100)
    assert q.current_s["step"] == pytest.approx(5.4)
    fixed = EnvDeadline(30.0, quantile=0.9, factor=0.0, floor_s=1.0)    # factor 0: off
    for _ in range(2 * MIN_SAMPLES):
        fixed.record("step", 0.1)
    assert fixed.current_s["step"] == 30.0
    assert adaptive().current_s == {"reset": 30.0, "step": 30.0}


def test_a_step_is_never_cut_before_its_verifier_times_out():
    """The verifier (a step's reward) has its own timeout, after which it scores 0: the step's deadline
    stays above it even when steps are fast; resets keep the plain floor."""
    d = EnvDeadline(30.0, quantile=0.9, factor=3.0, floor_s=1.0, reward_s=10.0)
    for _ in range(MIN_SAMPLES):
        d.record("step", 0.1)
        d.record("reset", 0.1)
    assert d.current_s == {"reset": 1.0, "step": 15.0}
    assert adaptive(reward_s=4.0).floor_s == {"reset": 5.0, "step": 6.0}


def test_env_deadline_timeouts_move_it_only_when_more_than_one_minus_q_of_calls_time_out():
    """Timed-out calls are recorded at their limit: a few (< 1 - q of the window) never raise the deadline,
    so hung calls are cut at the same deadline; many mean a kind of call is slow, not stuck, and the
    deadline grows by `factor` a round instead of cutting all of them forever."""
    d = EnvDeadline(30.0, quantile=0.99, factor=3.0, floor_s=0.01)
    for _ in range(200):
        d.record("step", 0.1)
    assert d.current_s["step"] == pytest.approx(0.3)
    for _ in range(2):                                         # 2 of 202 calls: under 1%
        d.record("step", d.current_s["step"])
    assert d.current_s["step"] == pytest.approx(0.3)
    for _ in range(2):                                         # 4 of 204: over 1%
        d.record("step", d.current_s["step"])
    assert d.current_s["step"] == pytest.approx(0.9)


@pytest.mark.parametrize("factor, cut_at", [(3.0, 1.0), (0.0, 30.0)])
def test_hung_env_is_cut_at_the_adaptive_deadline_not_the_ceiling(tok, factor, cut_at):
    """Envs whose calls take ~0.1 s, then three whose reset hangs forever: with the adaptive deadline
    (0.99-quantile ~0.15 s x 3 < the 1 s floor) each hang fails after 1 s, not the 30 s ceiling, is counted
    as an env timeout and retried with a fresh env; with env_timeout_factor 0 it takes the full 30 s.
    Three timeouts in 113 resets are more than 1%: afterwards the reset deadline is one round (x3) up."""
    rng = random.Random(0)
    hung = set()

    def wrap(env):
        env = LatencyEnv(env, 0.1, 0.02, rng)
        if env.env.problem.prompt == "3+4=" and id(env.env.problem) not in hung:   # its first env only
            hung.add(id(env.env.problem))
            return FaultyEnv(env, 0.0, 1.0, rng)
        return env

    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, deadline=adaptive(env_timeout_factor=factor, env_timeout_floor_s=1.0,
                                                      reward_s=0.01),   # (no verifier here)
                         env_wrappers=wrap,
                         length_sampler=lambda rng: 2)
        before = m.stats()["env_deadline_s"]
        run = asyncio.create_task(m.run())
        await buf.put_tasks([add_task(f"ok{i}", f"g{i}") for i in range(MIN_SAMPLES + 10)])
        await collect(buf, MIN_SAMPLES + 10)
        t0 = now()
        await buf.put_tasks([add_task(f"hang{i}", f"h{i}", prompt="3+4=", answer="7") for i in range(3)])
        got = await collect(buf, 6)
        [stats] = await stop_all(buf, [m], [run])
        return before, t0, got, stats
    before, t0, got, stats = run_virtual(main())
    assert before == {"reset": 30.0, "step": 30.0}
    failed = [(t, s) for t, s in got if s.failed]
    assert len(failed) == 3 and all(s.meta["timeout"] and s.meta["retrying"] for _, s in failed)
    assert all(t - t0 == pytest.approx(cut_at, abs=0.05) for t, _ in failed)
    assert all(f"{cut_at:g}s" in s.meta["error"] and "reset" in s.meta["error"] for _, s in failed)
    assert sorted(s.task_id for _, s in got if not s.failed) == ["hang0", "hang1", "hang2"]   # retried
    assert (stats["env_timeouts"], stats["retries"], stats["samples_failed"]) == (3, 3, 3)
    assert stats["env_deadline_s"] == ({"reset": 3.0, "step": 1.0} if factor else before)


def test_adaptive_deadline_follows_an_env_that_gets_slower(tok):
    """Steps take ~0.1 s, then every step takes 5 s (a slow verifier, a loaded sandbox): the first are cut
    at the 1 s floor, but as more than 1% of steps time out the deadline grows (x3 a round) until 5 s
    steps complete: every trajectory ends with a sample, the deadline above 5 s."""
    rng = random.Random(0)
    slow = []

    class Slow:
        def __init__(self, env):
            self.env = env

        async def reset(self, seed):
            return await self.env.reset(seed)

        async def step(self, action):
            await asyncio.sleep(5.0 if slow else 0.1)
            return await self.env.step(action)

    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        cfg = rcfg(max_concurrency=16, max_retries=3)
        m = make_manager(buf, tok, cfg=cfg, deadline=adaptive(cfg, env_timeout_floor_s=1.0,
                                                              reward_s=0.01),   # (no verifier here)
                         length_sampler=lambda rng: 2,
                         env_wrappers=lambda env: Slow(LatencyEnv(env, 0.01, 0.0, rng)))
        run = asyncio.create_task(m.run())
        await buf.put_tasks([add_task(f"fast{i}", f"f{i}") for i in range(MIN_SAMPLES + 10)])
        await collect(buf, MIN_SAMPLES + 10)
        fast_deadline = m.stats()["env_deadline_s"]["step"]
        slow.append(True)
        await buf.put_tasks([add_task(f"slow{i}", f"s{i}") for i in range(32)])
        samples, ok = [], set()
        while len(ok) < 32:
            [(_, s)] = await collect(buf, 1)
            samples.append(s)
            ok |= {s.task_id} if not s.failed else set()
        [stats] = await stop_all(buf, [m], [run])
        return fast_deadline, samples, stats
    fast_deadline, samples, stats = run_virtual(main())
    assert fast_deadline == 1.0
    assert not any(s.failed and not s.meta["retrying"] for s in samples)    # none given up
    assert 0 < stats["env_timeouts"] <= 2 * 32 and stats["env_deadline_s"]["step"] > 5.0


def test_engine_failure_stops_run_naming_rank(tok):
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, rank=0)
        m.proxy.engine.hang = True
        await buf.put_tasks([add_task("t", "g")])
        with pytest.raises(RuntimeError, match="rollout rank 0") as e:
            await asyncio.wait_for(m.run(), 100)
        assert isinstance(e.value.__cause__, EngineError)
        assert m.stats()["in_flight"] == 0
    run_virtual(main())


# ---------------------------------------------------------------------------------------------
# commands


async def acks_until(buf, phase, version=None, timeout=100):
    """Every ack up to and including the first of `phase` (for `version`)."""
    got = []
    while not (got and got[-1].phase == phase and got[-1].version == version):
        got.append(await buf.get_ack(f"{phase} {version}", timeout=timeout))
    return got


def test_sync_aborts_stale_work_and_acks(tok):
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000), freshness=1)
        run = asyncio.create_task(m.run())
        await buf.put_tasks([add_task("old", "g0", target_len=1000)])
        await asyncio.sleep(10 * STEP)
        await buf.send_command(0, Command(Cmd.SYNC, 1))                   # 0 >= 1 - 1: still fresh
        synced = (await acks_until(buf, Phase.SYNCED, 1))[-1]
        assert (synced.rank, synced.phase, synced.version) == (0, Phase.SYNCED, 1)
        assert m.stats()["in_flight"] == 1
        await buf.put_tasks([add_task("new", "g1", target_len=1000)])       # starts at version 1
        await asyncio.sleep(10 * STEP)
        await buf.send_command(0, Command(Cmd.SYNC, 2))                   # 0 < 2 - 1: "old" is stale
        assert (await acks_until(buf, Phase.SYNCED, 2))[-1].version == 2
        s = m.stats()
        assert (s["aborted_stale"], s["in_flight"]) == (1, 1)
        assert list(m.jobs) == ["new"] and len(m.proxy.engine.running) == 1   # the engine dropped it
        [(_, notice), (_, new)] = await collect(buf, 2)
        [stats] = await stop_all(buf, [m], [run])
        assert buf.get_sample_nowait() is None
        return m.proxy.engine.num_loads, notice, new, stats
    loads, notice, new, stats = run_virtual(main())
    assert loads == 2
    # "old" sent only a notice that it will never come (its group frees its admission place): no tokens
    assert (notice.task_id, notice.failed, notice.meta["aborted"], notice.meta["retrying"]) == (
        "old", True, Lost.STALE, False) and notice.response_ids == []
    assert new.task_id == "new" and new.versions[0] == 1 and new.versions[-1] == 2
    assert stats["proxy"]["version"] == 2 and stats["samples_sent"] == 1


def test_one_weight_update_ack_sequence_and_payloads(tok):
    """One SYNC through the real EnvManager on the fake engine: the acks are READY then SYNCED, each
    carrying what controller.py's table says. The engine is suspended for the whole transfer (its
    workers receive straight into the model: nothing is generated meanwhile, the request in flight
    is kept), gets the command's meta and group rank, and is running again at SYNCED."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        seen = {}
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000), probe_ids=[3, 4, 5, 6], load_s=2.0)
        receive = m.proxy.engine.receive_weights

        async def watched(spec, first_rank, meta):      # the transfer + load: 2 s = 20 decode steps
            tokens = m.proxy.num_tokens
            await receive(spec, first_rank, meta)
            if meta:
                seen.update(status=m.proxy.status, loads=m.proxy.engine.num_loads, meta=meta,
                            first_rank=first_rank, tokens_during=m.proxy.num_tokens - tokens,
                            acks_sent=len(acks) + buf.transport.qsize("acks"))
        m.proxy.engine.receive_weights = watched
        run = asyncio.create_task(m.run())
        await buf.put_tasks([add_task("busy", "g0", target_len=500)])     # work in flight across the update
        acks = [await buf.get_ack("ready", timeout=10)]
        await asyncio.sleep(5 * STEP)
        t0 = now()
        await buf.send_command(0, Command(Cmd.SYNC, 1, layout=[("w", [3], "float32")], probe=True))
        acks.append(await buf.get_ack("synced", timeout=100))
        elapsed = now() - t0
        after = (m.proxy.status, m.proxy.version, m.proxy.engine.num_loads, m.stats()["in_flight"])
        await buf.send_command(0, Command(Cmd.SYNC, 2))                 # no probe asked: none sent
        no_probe = (await acks_until(buf, Phase.SYNCED, 2))[-1]
        await stop_all(buf, [m], [run])
        return acks, seen, elapsed, after, no_probe
    acks, seen, elapsed, after, no_probe = run_virtual(main())
    ready, synced = acks
    assert (ready.rank, ready.phase, ready.version) == (0, Phase.READY, None)
    assert ready.probe == [-1.0] * 3 and ready.engine["version"] == 0     # the initial weights, scored
    # during the transfer: suspended, no token generated, READY the only ack sent
    assert seen == {"status": Status.SUSPENDED, "loads": 1, "meta": [("w", [3], "float32")], "first_rank": 1,
                    "tokens_during": 0, "acks_sent": 1}
    assert (synced.rank, synced.phase, synced.version) == (0, Phase.SYNCED, 1) and not synced.needs_weights
    assert synced.engine["version"] == 1 and synced.engine["in_flight"] == 1 and synced.engine["busy_s"] > 0
    assert synced.probe == [-1.0 / 2] * 3          # the fake engine's logprob after one load, per probe token
    assert synced.timings["receive_s"] == pytest.approx(2.0, abs=0.01) and synced.timings["load_s"] >= 2.0
    assert elapsed >= 2.0
    assert after == (Status.RUNNING, 1, 1, 1)       # resumed, loaded once, the request survived (keep mode)
    assert no_probe.probe is None and no_probe.version == 2


class SlowStep:
    """An env whose step (the verifier, say) takes step_s seconds; `stepping` is set as one starts."""

    def __init__(self, env, step_s: float, stepping: asyncio.Event):
        self.env, self.step_s, self.stepping = env, step_s, stepping

    async def reset(self, seed):
        return await self.env.reset(seed)

    async def step(self, action):
        self.stepping.set()
        await asyncio.sleep(self.step_s)
        return await self.env.step(action)


def watch_receive(m, seen: list | None = None) -> asyncio.Event:
    """Wrap the fake engine's receive: the event is set when a receive starts; `seen` gets
    "cancelled" if one is cancelled."""
    receive, receiving = m.proxy.engine.receive_weights, asyncio.Event()

    async def watched(spec, first_rank, meta):
        receiving.set()
        try:
            await receive(spec, first_rank, meta)
        except asyncio.CancelledError:
            if seen is not None:
                seen.append("cancelled")
            raise
    m.proxy.engine.receive_weights = watched
    return receiving


def test_a_sample_that_finishes_during_a_slow_receive_is_sent_before_the_sync_ends(tok):
    """The engine is suspended for a 10 s receive while a trajectory whose generation ended before
    it is in its 1 s step (the reward): its sample reaches the buffer when that step ends, with the
    engine still receiving, not when the sync ends."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        stepping = asyncio.Event()
        m = make_manager(buf, tok, load_s=10.0, length_sampler=lambda rng: 5,
                         env_wrappers=lambda env: SlowStep(env, 1.0, stepping))
        run = asyncio.create_task(m.run())
        await buf.put_tasks([add_task("t", "g")])
        await asyncio.wait_for(stepping.wait(), 100)
        t0 = now()
        await buf.send_command(0, Command(Cmd.SYNC, 1))
        [(t, s)] = await collect(buf, 1, timeout=100)
        during = (m.proxy.status, m.proxy.engine.num_loads)
        await acks_until(buf, Phase.SYNCED, 1)
        t_synced = now()
        await stop_all(buf, [m], [run])
        return t0, t, s, during, t_synced
    t0, t, s, during, t_synced = run_virtual(main())
    assert during == (Status.SUSPENDED, 0)             # the engine was still receiving ...
    assert t - t0 == pytest.approx(1.0, abs=0.05)      # ... when the sample was sent: as its step ended
    assert t_synced - t0 >= 10.0
    assert not s.failed and len(s.versions) == 5 and set(s.versions) == {0}


def test_free_slots_take_tasks_during_a_slow_receive_and_their_tokens_are_the_new_version(tok):
    """A task queued while the engine receives for 10 s starts at once (its env reset runs during
    the receive). Its first token can only come after the resume, so even at async ratio 0 the sync
    does not abort it as stale: every token it has is version 1."""
    resets, proxies = [], []

    class Watched:
        def __init__(self, env):
            self.env = env

        async def reset(self, seed):
            resets.append((now(), proxies[0].status))
            return await self.env.reset(seed)

        async def step(self, action):
            return await self.env.step(action)

    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, freshness=0, load_s=10.0, length_sampler=lambda rng: 5,
                         env_wrappers=Watched)
        proxies.append(m.proxy)
        receiving = watch_receive(m)
        run = asyncio.create_task(m.run())
        await acks_until(buf, Phase.READY)
        t0 = now()
        await buf.send_command(0, Command(Cmd.SYNC, 1))
        await asyncio.wait_for(receiving.wait(), 100)
        await buf.put_tasks([add_task("t", "g")])
        [(_, s)] = await collect(buf, 1, timeout=100)
        [stats] = await stop_all(buf, [m], [run])
        return t0, s, stats
    t0, s, stats = run_virtual(main())
    [(t_reset, status)] = resets
    assert status == Status.SUSPENDED and t_reset - t0 < 1.0     # started during the receive
    assert not s.failed and len(s.versions) == 5 and set(s.versions) == {1}
    assert (stats["aborted_stale"], stats["tasks_started"]) == (0, 1)


def test_tasks_queued_with_the_sync_that_wakes_a_slept_engine_are_not_stale(tok):
    """--colocate: the engine sleeps (suspended), then tasks of the next step and the SYNC that
    wakes it arrive together. The rank may start them before the sync runs (the engine is suspended
    already), but they generate after its resume: at async ratio 0 none is aborted as stale."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, freshness=0, length_sampler=lambda rng: 5)
        run = asyncio.create_task(m.run())
        await acks_until(buf, Phase.READY)
        await buf.send_command(0, Command(Cmd.SLEEP))
        await acks_until(buf, Phase.SLEPT)
        await buf.put_tasks([add_task(f"t{i}", f"g{i}") for i in range(4)])
        await buf.send_command(0, Command(Cmd.SYNC, 1))
        got = [s for _, s in await collect(buf, 4, timeout=100)]
        [stats] = await stop_all(buf, [m], [run])
        return got, stats
    got, stats = run_virtual(main())
    assert all(not s.failed and set(s.versions) == {1} for s in got)
    assert (stats["aborted_stale"], stats["tasks_started"]) == (0, 4)


@pytest.mark.parametrize("failure", ["raises", "times out"])
def test_a_sync_that_fails_ends_the_rank_loudly_and_leaves_no_work(tok, failure):
    """Without an engine to restart, a receive that fails, or a sync longer than sync_timeout_s,
    ends run() with an error naming the rank and the phase; the work in flight is ended."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000), load_s=10.0)
        m.sync_timeout_s = 5.0
        if failure == "raises":
            async def broken(spec, first_rank, meta):
                await asyncio.sleep(1.0)
                raise RuntimeError("the receive broke")
            m.proxy.engine.receive_weights = broken
        run = asyncio.create_task(m.run())
        await buf.put_tasks([add_task("busy", "g", target_len=1000)])
        await acks_until(buf, Phase.READY)
        await asyncio.sleep(5 * STEP)
        await buf.send_command(0, Command(Cmd.SYNC, 1))
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(run, 100)
        left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("rank0")]
        return e.value, m, left
    err, m, left = run_virtual(main())
    if failure == "raises":
        assert isinstance(err, EngineError) and str(err).startswith(
            "rollout rank 0: engine failed during update_weights: RuntimeError('the receive broke')")
    else:
        assert isinstance(err, TimeoutError)
        assert str(err) == "rollout rank 0: weight sync to version 1 took longer than 5s"
    assert m.stats()["in_flight"] == 0 and m.proxy.num_in_flight == 0 and left == []


def test_a_rank_cancelled_during_a_sync_leaves_no_task_behind(tok):
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000), load_s=10.0)
        seen = []
        receiving = watch_receive(m, seen)
        run = asyncio.create_task(m.run())
        await buf.put_tasks([add_task("busy", "g", target_len=1000)])
        await acks_until(buf, Phase.READY)
        await buf.send_command(0, Command(Cmd.SYNC, 1))
        await asyncio.wait_for(receiving.wait(), 100)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, 100)
        left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("rank0")]
        return seen, left, m
    seen, left, m = run_virtual(main())
    assert seen == ["cancelled"] and left == [] and m.stats()["in_flight"] == 0


def test_a_rank_cancelled_as_its_loop_wakes_ends(tok):
    """The control loop sleeps a poll period or until a slot frees (the wake event). A cancel that
    lands in the same loop pass as the wake must end the rank: Python 3.11's asyncio.wait_for
    swallows such a cancel (it returns the inner result), and a cancelled rank then ran on for ever
    (tools/bench_rollout.py hung in CI that way). Each round wakes the loop and cancels it at once."""
    async def main():
        ended = []
        for i in range(20):
            buf = SampleBuffer(LocalQueues(1), "test")
            m = make_manager(buf, tok)
            await buf.put_tasks([add_task(f"t{i}-{j}", f"g{i}-{j}", target_len=50) for j in range(4)])
            run = asyncio.create_task(m.run())
            await acks_until(buf, Phase.READY)
            await asyncio.sleep(0.2 + 0.0037 * i)     # mid poll period: the loop is asleep in its wait
            m.wake.set()
            run.cancel()
            done, _ = await asyncio.wait({run}, timeout=100)
            ended.append(bool(done) and run.cancelled())
            if not done:            # (the old code: cancel again until it ends, so the test ends)
                while not run.done():
                    run.cancel()
                    await asyncio.wait({run}, timeout=1)
        return ended
    assert run_virtual(main()) == [True] * 20


def test_abort_groups_and_stop(tok):
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_concurrency=2, max_model_len=2000))
        for tid, gid, n in [("a1", "a", 500), ("b1", "b", 500), ("a2", "a", 5), ("c1", "c", 5)]:
            await buf.put_tasks([add_task(tid, gid, target_len=n)])
        run = asyncio.create_task(m.run())
        await asyncio.sleep(1.0)
        assert set(m.jobs) == {"a1", "b1"}
        await buf.send_command(0, Command(Cmd.ABORT_GROUPS, group_ids=["a"]))
        got = await collect(buf, 1)       # a2 is skipped (its group was aborted), c1 runs
        assert m.stats()["in_flight"] == 1 and set(m.jobs) == {"b1"}
        [stats] = await stop_all(buf, [m], [run])                       # b1 is still running
        assert buf.get_sample_nowait() is None and not m.proxy.engine.running
        return got, stats
    got, stats = run_virtual(main())
    assert [s.task_id for _, s in got] == ["c1"]
    assert (stats["aborted_by_request"], stats["tasks_skipped"], stats["aborted_at_stop"]) == (1, 1, 1)
    assert stats["in_flight"] == 0 and stats["tasks_started"] == 3


# ---------------------------------------------------------------------------------------------
# multi-turn trajectories


def test_multi_turn_masks_logprobs_and_versions(tok):
    """ChainEnv with scripted answers: right, wrong, right. Observation tokens are masked with
    logprob 0; action tokens (EOS included) carry the engine's logprob (-1.0 on the fake)."""
    gid = "chain-group"
    env = ChainEnv()
    run_virtual(env.reset(env_seed(gid)))
    truth = [sum(env.terms[: i + 2]) for i in range(3)]

    def respond(prompt_ids):
        turn = tok.decode(prompt_ids).count("=") - 1
        return tok.encode(str(truth[turn] + (1 if turn == 1 else 0))) + [tok.eos_token_id]

    s = run_one_task(tok, add_task("c", gid, env="chain"), respond=respond)
    t = env.terms
    assert tok.decode(s.prompt_ids) == f"{t[0]}+{t[1]}="
    actions = [f"{truth[0]}<eos>", f"{truth[1] + 1}<eos>", f"{truth[2]}<eos>"]
    observations = [f" ok\n+{t[2]}=", f" no, {truth[1]}\n+{t[3]}="]
    expect_mask = []
    for i, a in enumerate(actions):
        expect_mask += [1] * len(tok.encode(a))
        if i < 2:
            expect_mask += [0] * len(tok.encode(observations[i]))
    assert tok.decode(s.response_ids) == (actions[0] + observations[0] + actions[1] + observations[1]
                                          + actions[2])
    assert s.loss_mask == expect_mask
    assert s.logprobs == [-1.0 if k else 0.0 for k in expect_mask]
    assert len(s.versions) == sum(expect_mask) and s.versions == [0] * sum(expect_mask)
    assert s.reward == pytest.approx(2 / 3) and s.num_turns == 3 and s.finish_reason == "stop"


def test_multi_turn_stops_at_token_cap(tok):
    """A guesser that always says 99 on a game whose secret is lower never wins; the trajectory
    ends when the next turn no longer fits max_model_len, with the reward so far."""
    gid = next(f"g{i}" for i in itertools.count() if _secret(f"g{i}") < 99)

    s = run_one_task(tok, add_task("g", gid, env="guess"), cfg=rcfg(max_model_len=60, max_turns=50),
                     respond=script(tok, "99"))
    assert s.num_tokens <= 60 and s.num_tokens + len(tok.encode(" lower:\n")) + 1 > 60
    assert s.finish_reason == "length" and s.reward == 0.0 and 1 < s.num_turns < 50
    assert tok.decode(s.response_ids).startswith("99<eos> lower:\n99<eos>")
    assert s.loss_mask[-1] == 1                                     # ends on an action, not an observation


def test_multi_turn_stops_at_max_turns(tok):
    gid = next(f"g{i}" for i in itertools.count() if _secret(f"g{i}") < 99)

    s = run_one_task(tok, add_task("g", gid, env="guess"), cfg=rcfg(max_turns=3), respond=script(tok, "99"))
    # no trailing observation
    assert tok.decode(s.response_ids) == "99<eos> lower:\n99<eos> lower:\n99<eos>"
    assert s.num_turns == 3 and s.finish_reason == "length" and s.loss_mask[-1] == 1


def _secret(gid):
    env = GuessEnv()
    run_virtual(env.reset(env_seed(gid)))
    return env.secret


# ---------------------------------------------------------------------------------------------
# envs


def test_guess_env_binary_search_wins_with_decayed_reward():
    async def main():
        env = GuessEnv()
        obs = await env.reset(123)
        assert obs == await GuessEnv().reset(123) and env.secret == _secret_of(123)
        lo, hi, turns = 0, 99, 0
        while True:
            g = (lo + hi) // 2
            obs, r, done, _ = await env.step(f"{g}")
            turns += 1
            if done:
                return obs, r, turns
            assert r == 0.0
            lo, hi = (g + 1, hi) if "higher" in obs else (lo, g - 1)
    obs, r, turns = run_virtual(main())
    assert "correct" in obs and turns <= 7 and r == pytest.approx(0.9 ** (turns - 1))


def _secret_of(seed):
    return random.Random(seed).randrange(100)


def test_env_text_uses_only_tiny_model_chars():
    from tiny_model import CHARS

    async def main():
        texts = []
        for seed in range(20):
            g, c = GuessEnv(), ChainEnv()
            texts += [await g.reset(seed), await c.reset(seed)]
            for a in ("", "5", "200", "x"):
                texts.append((await g.step(a))[0])
            for a in ("3", "999", ""):
                texts.append((await c.step(a))[0])
        return texts
    assert set("".join(run_virtual(main()))) <= set(CHARS)


def test_envs_dict_builds_every_env():
    p = Problem("1+1=", "2")
    for name, factory in ENVS.items():
        env = factory(p, 7)
        obs = run_virtual(env.reset(7))
        assert isinstance(obs, str) and obs
    assert isinstance(ENVS[""](p, 0), SingleTurnEnv)
    assert run_virtual(ENVS[""](p, 0).step("2")) == ("", 1.0, True, {})


def test_latency_env_mean_and_clipping():
    async def mean_delay(mean, std, n=400):
        env = LatencyEnv(GuessEnv(), mean, std, random.Random(1))
        t0 = now()
        await env.reset(0)
        for _ in range(n - 1):
            await env.step("50")
        return (now() - t0) / n
    assert run_virtual(mean_delay(10.0, 2.0)) == pytest.approx(10.0, abs=0.3)
    # the paper's mu = sigma = 10: negative draws are clipped to 0, so E = 10 Phi(1) + 10 phi(1) = 10.83
    assert run_virtual(mean_delay(10.0, 10.0, n=2000)) == pytest.approx(10.83, abs=0.5)


def test_faulty_env_rates():
    async def main(fail_rate, hang_rate, n=1000):
        env = FaultyEnv(GuessEnv(), fail_rate, hang_rate, random.Random(2))
        fails = hangs = 0
        for i in range(n):
            try:
                await asyncio.wait_for(env.step("1"), 1.0)
            except EnvFault:
                fails += 1
            except asyncio.TimeoutError:
                hangs += 1
        return fails / n, hangs / n
    fails, hangs = run_virtual(main(0.2, 0.1))
    assert fails == pytest.approx(0.2, abs=0.04) and hangs == pytest.approx(0.1, abs=0.03)
    with pytest.raises(ValueError, match="fail_rate"):
        FaultyEnv(GuessEnv(), 0.7, 0.7, random.Random(0))


def test_config_validates():
    for cls, field, bad in [(RolloutConfig, "max_concurrency", 0), (VerifierConfig, "reward_workers", -2),
                            (RolloutConfig, "env_step_timeout_s", 0), (RolloutConfig, "max_tokens", -1),
                            (DeadlineConfig, "env_timeout_quantile", 0),
                            (DeadlineConfig, "env_timeout_quantile", 1.5),
                            (DeadlineConfig, "env_timeout_factor", -1),
                            (DeadlineConfig, "env_timeout_floor_s", 0),
                            (VerifierConfig, "reward_timeout_factor", -1),
                            (VerifierConfig, "reward_timeout_min_s", 0)]:
        with pytest.raises(ValueError, match=field.replace("_", "-")):
            cls(**{field: bad})
    with pytest.raises(ValueError, match=r"--env-timeout-quantile .*must be in \(0, 1\]"):
        DeadlineConfig(env_timeout_quantile=2.0)


def test_reward_workers_process_pool(tok):
    """reward_workers > 0: the verifier runs in a process pool (real time, tiny fake steps)."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, scorer=RewardPool(1), t0=0.001, respond=script(tok, "2"))
        await buf.put_tasks([add_task("a", "g", prompt="1+1=", answer="2")])
        await buf.put_tasks([add_task("b", "g", prompt="1+2=", answer="3")])
        run = asyncio.create_task(m.run())
        got = sorted((s.task_id, s.reward) for _, s in await collect(buf, 2, timeout=30))
        await stop_all(buf, [m], [run])
        return got
    assert asyncio.run(main()) == [("a", 1.0), ("b", 0.0)]


def with_engine_restarts(m) -> list:
    """Give manager m a recovery (ext/recovery.py, as in a run) whose restart_engine starts fresh fake
    engines; returns the list they go in."""
    fresh = []

    async def restart_engine():
        fresh.append(FakeTimedEngine(t0=STEP, k=0.0, seed=7, length_sampler=lambda rng: 5))
        return fresh[-1]
    m.recovery = EngineRecovery(restart_engine)
    return fresh


def test_a_wedged_engine_is_replaced_and_waits_for_weights_and_its_samples_counted_lost(tok):
    """The engine stops answering with work in flight: the proxy's watchdog notices within its
    timeout, every in-flight sample is reported as given up (lost to the engine), a new engine is
    started. It holds the model dir's weights, not the synced ones: the rank acks REPLACED and keeps
    it suspended until the next SYNC (the controller's resync), then serves new work at that version."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000), length_sampler=lambda rng: 5)
        fresh_engines = with_engine_restarts(m)
        run = asyncio.create_task(m.run())
        await buf.send_command(0, Command(Cmd.SYNC, 3, spec=group_spec()))   # generation 0
        await acks_until(buf, Phase.SYNCED, 3)
        for i in range(4):
            await buf.put_tasks([add_task(f"t{i}", f"g{i}", target_len=1000)])
        await asyncio.sleep(5 * STEP)
        old = m.proxy.engine
        old.hang = True                                   # wedged: no more tokens, ever
        t0 = now()
        lost = [s for _, s in await collect(buf, 4, timeout=200)]
        detected = now() - t0
        replaced = (await acks_until(buf, Phase.REPLACED, 3))[-1]
        await buf.put_tasks([add_task("after", "g9")])
        await asyncio.sleep(20 * STEP)
        waiting = (m.proxy.status, fresh_engines[0].num_loads, buf.get_sample_nowait())
        await buf.send_command(0, Command(Cmd.SYNC, 3, spec=group_spec()))   # the old generation: not joined
        stale = (await acks_until(buf, Phase.SYNCED, 3))[-1]
        loads_then = fresh_engines[0].num_loads
        await buf.send_command(0, Command(Cmd.SYNC, 3, spec=group_spec().with_gen(1)))   # the resync
        await acks_until(buf, Phase.SYNCED, 3)
        [(_, after)] = await collect(buf, 1, timeout=200)
        [stats] = await stop_all(buf, [m], [run])
        return (lost, detected, replaced, (*waiting, stale.needs_weights, loads_then), after, stats,
                fresh_engines)
    lost, detected, replaced, waiting, after, stats, fresh = run_virtual(main())
    assert sorted(s.task_id for s in lost) == ["t0", "t1", "t2", "t3"]
    assert all(s.failed and s.meta["engine_lost"] and not s.meta["retrying"] for s in lost)
    assert detected <= 30.0 + 30.0 / 8 + 1                # within the proxy's timeout (+ one watchdog period)
    assert (replaced.rank, replaced.version) == (0, 3)
    # nothing generated with the model dir's weights; a SYNC over the group its predecessor was in is
    # refused (needs_weights, nothing received: its keys name the dead worker), the next generation loads
    assert waiting == (Status.SUSPENDED, 0, None, True, 0)
    assert len(fresh) == 1 and fresh[0].num_loads == 1     # the new engine got the resync ...
    assert not after.failed and set(after.versions) == {3}  # ... at its version, and serves new work
    assert (stats["engine_restarts"], stats["samples_lost_to_engine"]) == (1, 4)


def test_an_engine_that_dies_during_a_sync_is_replaced_and_the_resync_completes(tok):
    """The engine dies after the load, while the rank scores the probe for the SYNCED ack (seen
    under torchrun with a SIGKILLed engine worker): the rank starts a new engine, acks SYNCED with
    needs_weights and then REPLACED; the controller's next SYNC loads the new engine, with the probe."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000), probe_ids=[1, 2, 3],
                         length_sampler=lambda rng: 5)
        fresh_engines = with_engine_restarts(m)

        async def dead_score(token_ids):
            raise RuntimeError("EngineCore encountered an issue")     # what vLLM raises once its core is gone
        run = asyncio.create_task(m.run())
        await acks_until(buf, Phase.READY)
        m.proxy.engine.score = dead_score
        await buf.send_command(0, Command(Cmd.SYNC, 4, probe=True))
        failed = (await acks_until(buf, Phase.SYNCED, 4))[-1]
        replaced = (await acks_until(buf, Phase.REPLACED, 4))[-1]
        await buf.send_command(0, Command(Cmd.SYNC, 4, probe=True))
        synced = (await acks_until(buf, Phase.SYNCED, 4))[-1]
        await buf.put_tasks([add_task("after", "g9")])
        [(_, after)] = await collect(buf, 1, timeout=200)
        [stats] = await stop_all(buf, [m], [run])
        return failed, replaced, synced, after, stats, fresh_engines
    failed, replaced, synced, after, stats, fresh = run_virtual(main())
    assert failed.needs_weights and failed.probe is None and replaced.rank == 0
    assert not synced.needs_weights and synced.probe is not None and len(synced.probe) == 2
    assert stats["engine_restarts"] == 1 and len(fresh) == 1 and fresh[0].num_loads == 1
    assert not after.failed and set(after.versions) == {4}


def test_a_broken_group_keeps_the_engine_suspended_until_the_next_sync(tok):
    """Another member died mid-broadcast: this engine's receive fails too (gloo closes the group),
    but the engine lives. It is not replaced: SYNCED says needs_weights, no REPLACED, and it waits
    suspended for the next SYNC."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000), length_sampler=lambda rng: 5)
        fresh_engines = with_engine_restarts(m)
        receive, calls = m.proxy.engine.receive_weights, []

        async def breaks_once(spec, first_rank, meta):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("engine worker (weight-sync rank 1, gen 0): weight broadcast "
                                   "bucket 0 failed")
            await receive(spec, first_rank, meta)
        m.proxy.engine.receive_weights = breaks_once
        run = asyncio.create_task(m.run())
        await acks_until(buf, Phase.READY)
        await buf.send_command(0, Command(Cmd.SYNC, 1))
        failed = (await acks_until(buf, Phase.SYNCED, 1))[-1]
        waiting = m.proxy.status
        await buf.send_command(0, Command(Cmd.SYNC, 1))
        synced = (await acks_until(buf, Phase.SYNCED, 1))[-1]
        [stats] = await stop_all(buf, [m], [run])
        return failed, waiting, synced, stats, fresh_engines
    failed, waiting, synced, stats, fresh = run_virtual(main())
    assert failed.needs_weights and waiting == Status.SUSPENDED and not synced.needs_weights
    assert stats["engine_restarts"] == 0 and fresh == [] and stats["proxy"]["version"] == 1


def test_an_engine_that_dies_during_a_receive_is_replaced_once_with_tasks_started_meanwhile(tok):
    """Tasks start during a slow receive, then the engine process dies: the sync replaces it, once.
    Its task from before and the two started during the receive are reported lost, once each; a task
    queued while the new engine starts is not started with the dead one (it would fail, and the
    rank would replace the new engine too): it waits for the resync and runs at its version."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        m = make_manager(buf, tok, cfg=rcfg(max_model_len=2000), load_s=10.0, length_sampler=lambda rng: 5)
        fresh = with_engine_restarts(m)
        start_engine, restarting = m.recovery.restart_engine, asyncio.Event()

        async def slow_start():                     # an engine takes 5 s to start
            restarting.set()
            await asyncio.sleep(5.0)
            return await start_engine()
        m.recovery.restart_engine = slow_start
        m.proxy.engine.dead = False                 # (the backend can tell when its process dies)
        receiving = watch_receive(m)
        run = asyncio.create_task(m.run())
        await buf.put_tasks([add_task("before", "g0", target_len=1000)])
        await acks_until(buf, Phase.READY)
        await asyncio.sleep(5 * STEP)
        await buf.send_command(0, Command(Cmd.SYNC, 1))
        await asyncio.wait_for(receiving.wait(), 100)
        await buf.put_tasks([add_task(f"during{i}", f"g{i + 1}") for i in range(2)])
        await asyncio.sleep(1.0)
        started_during = sorted(m.jobs)
        m.proxy.engine.dead = True                  # mid-receive
        await asyncio.wait_for(restarting.wait(), 100)
        await buf.put_tasks([add_task("meanwhile", "g9")])
        lost = [s for _, s in await collect(buf, 3, timeout=100)]
        acks = await acks_until(buf, Phase.REPLACED, 0)      # (its version: the load failed)
        await buf.send_command(0, Command(Cmd.SYNC, 1))          # the controller's resync
        await acks_until(buf, Phase.SYNCED, 1)
        [(_, meanwhile)] = await collect(buf, 1, timeout=100)
        [stats] = await stop_all(buf, [m], [run])
        return started_during, lost, acks, meanwhile, stats, fresh
    started_during, lost, acks, meanwhile, stats, fresh = run_virtual(main())
    assert started_during == ["before", "during0", "during1"]
    assert sorted(s.task_id for s in lost) == ["before", "during0", "during1"]
    assert all(s.failed and s.meta["engine_lost"] for s in lost)
    assert [a.phase for a in acks if a.phase != Phase.READY] == [Phase.SYNCED, Phase.REPLACED]
    assert [a.needs_weights for a in acks if a.phase == Phase.SYNCED] == [True]
    assert not meanwhile.failed and meanwhile.task_id == "meanwhile" and set(meanwhile.versions) == {1}
    assert (stats["engine_restarts"], stats["samples_lost_to_engine"], len(fresh)) == (1, 3, 1)


# --- the controller and the rollout ranks: syncing replaced engines again, over a new group


def controller_with_ranks(tok, num_ranks=2, **engine_kwargs):
    from controller import AsyncController, ControllerConfig
    buf = SampleBuffer(LocalQueues(num_ranks), "test")
    problems = (Problem("1+1=", "2", target_len=5) for _ in itertools.count())
    ctrl = AsyncController(ControllerConfig(batch_groups=1, group_size=2, filter_groups=False, async_ratio=1,
                                            redundant=0, timeout_s=600), buf, problems, num_ranks,
                           recovery=SyncRecovery())
    managers = [make_manager(buf, tok, rank=r, cfg=rcfg(max_model_len=2000), length_sampler=lambda rng: 5,
                             **engine_kwargs) for r in range(num_ranks)]
    for m in managers:                   # (ext/recovery.py on both sides, as in a run)
        with_engine_restarts(m)
    return buf, ctrl, managers


def group_spec():
    from weight_sync import GroupSpec
    return GroupSpec("127.0.0.1", 1, "test", 0, 3)    # the fake engines join no group: only gen matters


def test_the_controller_syncs_a_replaced_engine_again_over_a_new_group_while_collecting(tok):
    async def main():
        buf, ctrl, managers = controller_with_ranks(tok)
        fresh = with_engine_restarts(managers[1])
        runs = [asyncio.create_task(m.run()) for m in managers]
        await ctrl.wait_ready()
        sent = []
        await ctrl.sync_weights(1, sent.append, layout=[("w", [2], "float32")], spec=group_spec())
        await ctrl.finish_sync()
        managers[1].proxy.engine.hang = True              # rank 1's engine wedges, with or without work
        await buf.put_tasks([add_task("x", "gx", target_len=1000)])
        batch, info = await ctrl.collect()                # rank 1 is replaced meanwhile; rank 0 alone
                                                          # cannot end it...
        loads = [m.proxy.engine.num_loads for m in managers]
        stats = await ctrl.stop()
        await asyncio.gather(*runs)
        return sent, ctrl, batch, loads, fresh, stats
    sent, ctrl, batch, loads, fresh, stats = run_virtual(main())
    assert [g.gen for g in sent] == [0, 1] and ctrl.gen == 1 and ctrl.recovery.resyncs == 1
    assert len(fresh) == 1 and loads == [2, 1]             # every engine loads the resync (rank 0: again)
    assert len(batch) == 2 and {v for s in batch for v in s.versions} == {1}
    assert stats[1]["engine_restarts"] == 1


def test_a_broadcast_that_fails_is_sent_again_over_a_new_group(tok):
    """An engine died mid-broadcast: the trainer's send fails and every rank's receive fails with
    it. The ranks ack needs_weights; the controller sends again over generation 1; the sync completes."""
    async def main():
        buf, ctrl, managers = controller_with_ranks(tok)
        runs = [asyncio.create_task(m.run()) for m in managers]
        await ctrl.wait_ready()
        for m in managers:
            receive, calls = m.proxy.engine.receive_weights, []

            async def breaks_once(spec, first_rank, meta, receive=receive, calls=calls):
                calls.append(spec.gen)
                if len(calls) == 1:
                    raise RuntimeError(f"engine worker (weight-sync rank {first_rank}, gen 0): weight "
                                       f"broadcast bucket 0 failed: Connection closed by peer")
                await receive(spec, first_rank, meta)
            m.proxy.engine.receive_weights = breaks_once
        sent = []

        def send(spec):
            sent.append(spec.gen)
            if len(sent) == 1:
                raise RuntimeError("trainer rank 0: weight broadcast bucket 0 (gen 0) failed")
        await ctrl.sync_weights(1, send, layout=[("w", [2], "float32")], spec=group_spec())
        report = await ctrl.sync_weights(2, send, layout=[("w", [2], "float32")], spec=group_spec())
        await ctrl.finish_sync()
        state = [(m.proxy.status, m.proxy.version, m.proxy.engine.num_loads) for m in managers]
        await ctrl.stop()
        await asyncio.gather(*runs)
        return sent, ctrl, report, state
    sent, ctrl, report, state = run_virtual(main())
    assert sent == [0, 1, 1] and ctrl.gen == 1 and ctrl.recovery.resyncs == 1
    assert report["synced_version"] == 1
    assert state == [(Status.RUNNING, 2, 2)] * 2


def test_env_deadline_keeps_its_window_sorted_as_it_slides():
    """The quantile reads a sorted copy of the window kept up to date per call (no sort per call):
    after any sequence of calls it is the window sorted, and the deadline is the sorted window's."""
    rng = random.Random(0)
    d = EnvDeadline(ceiling_s=1e9, quantile=0.9, factor=2.0, floor_s=0.0)
    for i in range(3 * WINDOW):
        d.record("step", rng.choice([rng.random(), 0.5, rng.lognormvariate(0, 2)]))   # ties included
        window = sorted(d.latencies["step"])
        assert d.ranked["step"] == window
        if len(window) >= MIN_SAMPLES:
            assert d.current_s["step"] == 2.0 * window[math.ceil(0.9 * len(window)) - 1]


def test_a_sleep_during_evaluation_runs_the_aborted_tasks_again_and_the_round_completes(tok):
    """--colocate --eval-every: SLEEP ends every running task, evaluation's too. Each ended task sends a
    notice, the controller queues that evaluation task again, and the round completes after the wake-up
    (before, the round's finish waited to its timeout and the final checkpoint was never written)."""
    async def main():
        buf, ctrl, managers = controller_with_ranks(tok, num_ranks=1)
        run = asyncio.create_task(managers[0].run())
        await ctrl.wait_ready()
        ev = Evaluation(ctrl)
        await ev.start([Problem("1+1=", "2"), Problem("2+2=", "4")], k=2)
        await asyncio.sleep(2 * STEP)                  # (virtual time) the 6 tasks run: 5 tokens take 5 steps
        assert len(managers[0].jobs) == 6
        await sleep_engines(ctrl)                     # the trainer takes the GPU
        aborted = managers[0].counters["aborted_by_request"]
        await ctrl.sync_weights(1, send_fn=lambda spec: None)   # wakes the engine
        result = await ev.finish()
        await ctrl.stop()
        await run
        return aborted, result
    aborted, result = run_virtual(main())
    assert aborted == 6
    assert result["eval_version"] == 0 and {"eval_greedy", "eval_mean_at_2"} <= set(result)


def filter_controller(tok, respond, **cfg):
    """One rank, batch 2 x 2, dynamic filtering on; the rank answers with respond(); heartbeats logged."""
    from controller import AsyncController, ControllerConfig
    buf = SampleBuffer(LocalQueues(1), "test")
    logs = []
    ctrl = AsyncController(ControllerConfig(batch_groups=2, group_size=2, async_ratio=0, redundant=0, **cfg),
                           buf, (Problem("1+1=", "2") for _ in itertools.count()), 1, log=logs.append)
    return ctrl, make_manager(buf, tok, respond=respond), logs


@pytest.mark.parametrize("action", ["error", "train"])
def test_dynamic_filtering_that_keeps_resampling_warns_and_stops_at_max_gen_batches(tok, action):
    """A model that almost never succeeds: every group but the first has all-equal rewards. The controller
    warns once (naming the reward mean and the flags) and, at --max-gen-batches batches of complete groups
    in one step, ends the run with a clear error or trains the one group it has, as asked."""
    calls = itertools.count()

    def respond(prompt_ids):          # right once (the first group's second sample), wrong ever after
        return tok.encode("2" if next(calls) == 1 else "3") + [tok.eos_token_id]

    async def main():
        ctrl, m, logs = filter_controller(tok, respond, max_gen_batches=3, on_max_gen_batches=action)
        run = asyncio.create_task(m.run())
        await ctrl.wait_ready()
        try:
            return await ctrl.collect(), logs
        finally:
            await ctrl.stop()
            await run
    if action == "error":
        with pytest.raises(RuntimeError, match=r"--max-gen-batches 3 reached: 5 groups .* all-equal rewards "
                                               r"\(reward mean 0\.083.*only 1 of 2 groups are ready"):
            run_virtual(main())
        return
    (batch, info), logs = run_virtual(main())
    assert len(batch) == 2 and sorted(s.reward for s in batch) == [0.0, 1.0] and info["groups_filtered"] == 5
    [warning] = [x for x in logs if x.startswith("dynamic filtering")]
    assert "reward mean" in warning and "--max-gen-batches" in warning and "--filter-groups false" in warning
