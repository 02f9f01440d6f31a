"""controller.py: admission under the async ratio (no engines: the task queue is inspected directly)."""

import asyncio
import itertools
import random

import pytest
from hypothesis import given, settings, strategies as st

from buffer import Ack, Cmd, LocalQueues, Phase, Sample, SampleBuffer
from controller import AsyncController, ControllerConfig
from task import problem_stream
from task import Problem, make_problem

pytestmark = pytest.mark.fast


def controller(version=0, **kw) -> AsyncController:
    cfg = ControllerConfig(**{"batch_groups": 4, "group_size": 2, "redundant": 0, **kw})
    problems = (Problem(f"{i}+0=", str(i)) for i in itertools.count())
    return AsyncController(cfg, SampleBuffer(LocalQueues(2), "test"), problems, num_rollout_ranks=2,
                           version=version)


@pytest.mark.parametrize("async_ratio", [0, 1, 2])
@pytest.mark.parametrize("start_version", [0, 7])
def test_admission_bounded_by_async_ratio(async_ratio, start_version):
    """(alpha + 1) batches + redundant prompts may hold places at once, whatever the starting version (a
    resumed run or a reused engine starts at version > 0 and must not flood the queue). A trained group frees
    its place when the next step begins, so a step that trained fewer than B frees only as many."""
    def next_step(c, trained):       # (as collect() sees it at a step's start: `trained` more groups trained)
        c.groups_taken += trained
        c.taken_before_step = c.groups_taken
        c.version += 1

    async def main():
        c = controller(start_version, async_ratio=async_ratio, redundant=1)
        n = await c.admit()
        assert n == (async_ratio + 1) * 4 + 1
        assert c.buffer.num_queued_tasks() == n * 2           # replication: one task per sample
        assert await c.admit() == 0                           # nothing more until a batch trains
        next_step(c, 4)
        assert await c.admit() == 4                           # one more batch per batch trained
        next_step(c, 1)
        assert await c.admit() == 1                           # a short step: one group, one place
        c.assembler.groups_filtered += 2                            # lost groups free their places
        assert await c.admit() == 2
    asyncio.run(main())


def test_no_replication_puts_one_task_per_prompt():
    async def main():
        c = controller(replicate=False)
        n = await c.admit()
        tasks = [t for t in c.buffer.transport.get_many_nowait("tasks", c.buffer.num_queued_tasks())]
        assert len(tasks) == n and all(t.num_samples == 2 for t in tasks)
    asyncio.run(main())


def test_problem_stream_resumes_at_position():
    a = list(itertools.islice(problem_stream(None, seed=3, make=make_problem), 10))
    b = list(itertools.islice(problem_stream(None, seed=3, start=6, make=make_problem), 4))
    assert [p.prompt for p in a[6:]] == [p.prompt for p in b]
    data = [Problem(str(i), str(i)) for i in range(5)]
    c = list(itertools.islice(problem_stream(data, seed=1), 10))
    assert sorted(p.prompt for p in c[:5]) == sorted(p.prompt for p in data)   # a shuffled pass, then another


def test_config_validation_names_the_flag():
    with pytest.raises(ValueError, match="async-ratio"):
        ControllerConfig(async_ratio=-1)
    with pytest.raises(ValueError, match="rollout-mode"):
        ControllerConfig(rollout_mode="fast")


def test_sync_timeout_names_the_rank_that_did_not_ack():
    """sync_weights returns after the broadcast; the SYNCED acks are awaited by the next sync (or
    finish_sync), and a rank that never acks is named."""
    async def main():
        c = controller(timeout_s=0.2)
        out = await c.sync_weights(1, send_fn=lambda spec: None)
        assert c.version == 1 and "sync_probe_max_diff" not in out      # nothing earlier to report
        sent = [c.buffer.transport.get_many_nowait("commands", 9, r) for r in (0, 1)]
        assert [[(m.kind, m.version) for m in cmds] for cmds in sent] == [[(Cmd.SYNC, 1)]] * 2
        # rank 0 answers, rank 1 never
        await c.buffer.put_ack(Ack(0, Phase.SYNCED, 1, engine={"busy_s": 1.0, "idle_s": 1.0},
                                   timings={"receive_s": 0.1, "load_s": 0.2}))
        with pytest.raises(TimeoutError, match=r"rollout rank\(s\) \[1\] did not ack synced for version 1"):
            await c.sync_weights(2, send_fn=lambda spec: None)
    asyncio.run(main())


def test_previous_sync_is_reported_by_the_next():
    async def main():
        c = controller()
        await c.buffer.put_ack(Ack(0, Phase.READY, engine={"busy_s": 0.0, "idle_s": 1.0}, probe=[-1.0, -2.0]))
        await c.buffer.put_ack(Ack(1, Phase.READY, engine={"busy_s": 0.0, "idle_s": 1.0}, probe=[-1.0, -2.5]))
        ready = await c.wait_ready(probe_ref=[-1.0, -2.0])
        assert ready["sync_probe_max_diff"] == 0.5 and ready["synced_version"] == 0
        first = await c.sync_weights(1, send_fn=lambda spec: None, probe_ref=[-3.0, -3.0])
        assert first["sync_probe_max_diff"] == 0.5 and first["synced_version"] == 0   # READY's check, once
        for r, busy in ((0, 1.5), (1, 0.5)):     # each engine: 2 s since READY, busy 1.5 and 0.5 of them
            await c.buffer.put_ack(Ack(r, Phase.SYNCED, 1, engine={"busy_s": busy, "idle_s": 3.0 - busy},
                                       probe=[-3.0, -3.25 + r],
                                       timings={"receive_s": 0.1 * r, "load_s": 0.3}))
        second = await c.sync_weights(2, send_fn=lambda spec: None)
        assert second["synced_version"] == 1 and second["sync_probe_max_diff"] == 0.75
        assert second["rollout_utilisation"] == pytest.approx(0.5)          # 2 busy of 4 engine-seconds
        assert (second["time_receive"], second["time_engine_load"]) == (0.1, 0.3)
    asyncio.run(main())


def test_samples_left_at_stop_count_failures_but_not_a_ranks_notices():
    """At stop, the samples still queued are counted unconsumed; of them only real env failures count as
    failures received (the books: every rank's samples_failed), not a rank's notices that a task was
    aborted or its engine lost (a test run once counted 165 failures received against the ranks' 164)."""
    from buffer import Sample

    def failed(**meta):
        return Sample("t0", "g0", [], [], [], [], [], 0.0, failed=True, meta={"retrying": False, **meta})
    async def main():
        c = controller()
        await c.buffer.put_samples([failed(error="boom"), failed(aborted="dropped_stale"),
                                    failed(engine_lost=True)])
        for r in (0, 1):
            await c.buffer.put_ack(Ack(r, Phase.STOPPED, stats={"rank": r}))
        await c.stop()
        assert (c.failed_received, c.samples_unconsumed) == (1, 3)
    asyncio.run(main())


def test_a_group_lost_twice_is_counted_once_and_its_running_samples_are_aborted():
    """A group dropped as stale whose straggler is then given up on must free one place, not two
    (else admission overshoots its bound); and when a sample is given up on, the rollout ranks are
    told to stop the group's other samples."""
    from buffer import Sample
    async def main():
        c = controller(async_ratio=0, batch_groups=1, group_size=2)
        await c.admit()
        c.buffer.transport.get_many_nowait("tasks", 100)
        stale = Sample("g0.0", "g0", [1], [2], [-1.0], [1], [-5], 1.0)       # a token from long ago: stale
        c.assembler.add(stale, c.version)
        gave_up = Sample("g0.1", "g0", [1], [], [], [], [], 0.0, failed=True, meta={"retrying": False})
        c.assembler.add(gave_up, c.version)
        assert c.assembler.groups_dropped_stale + c.assembler.groups_failed == 1
        # a live group given up on, through collect(): its siblings are aborted on every rank
        c2 = controller(async_ratio=1, batch_groups=1, group_size=3, timeout_s=0.3)
        await c2.admit()
        await c2.buffer.put_samples([Sample("g0.0", "g0", [1], [], [], [], [], 0.0, failed=True,
                                           meta={"retrying": False, "error": "gave up"})])
        with pytest.raises(TimeoutError):
            await c2.collect()
        return [c2.buffer.transport.get_many_nowait("commands", 9, r) for r in (0, 1)]
    sent = asyncio.run(main())
    for cmds in sent:
        assert [(m.kind, m.group_ids) for m in cmds] == [(Cmd.ABORT_GROUPS, ["g0"])]


# one event of a run: ("good" | "failed" | "gave_up" | "stale", which open task) or ("step",)
events = st.lists(st.one_of(st.tuples(st.sampled_from(["good", "failed", "gave_up", "stale"]),
                                      st.integers(0, 999)),
                            st.tuples(st.just("step"))), max_size=150)


@settings(max_examples=150, deadline=None)
@given(events=events, async_ratio=st.integers(0, 2), redundant=st.integers(0, 2))
def test_groups_outstanding_never_exceed_the_admission_bound(events, async_ratio, redundant):
    """Whatever happens to samples (rewarded, failed and retried, given up, stale) and whenever the
    trainer steps, the groups admitted and neither trained nor lost never exceed (alpha + 1) * B + R.
    Lost is counted from the assembler's sets (a group counts once however it was lost)."""
    from buffer import Sample
    B, G = 2, 2

    async def main():
        c = controller(async_ratio=async_ratio, redundant=redundant, batch_groups=B, group_size=G)
        open_tasks, admitted, taken, lost, rng = [], set(), set(), set(), random.Random(0)

        def outstanding():    # (lost accumulates: the assembler forgets long-resolved ids)
            ready = {g[0].group_id for g in c.assembler.ready}
            lost.update(c.assembler.dead | (c.assembler.closed - ready - taken))
            return len(admitted - taken - lost)
        for ev in [("admit",)] + events:
            await c.admit()
            new = c.buffer.transport.get_many_nowait("tasks", 10**6)
            open_tasks += new
            admitted |= {t.group_id for t in new}
            assert outstanding() <= (async_ratio + 1) * B + redundant
            if ev[0] == "admit":
                continue
            if ev[0] == "step":
                if c.assembler.num_ready() >= B:            # a training step: B groups taken, version + 1
                    outstanding()                         # (what was lost so far, before it is forgotten)
                    taken |= {g[0].group_id for g in c.assembler.take(B, c.version)}
                    c.groups_taken += B
                    c.version += 1
                    c.assembler.evict_stale(c.version)
                continue
            if not open_tasks:
                continue
            t = open_tasks[ev[1] % len(open_tasks)]
            kind = ev[0]
            if kind != "failed":                      # a failed attempt is retried: the task stays open
                open_tasks.remove(t)
            versions = [c.version - async_ratio - 1] if kind == "stale" else [c.version]
            c.assembler.add(Sample(t.task_id, t.group_id, [1], [2], [-1.0], [1], versions,
                             float(rng.random() < 0.5), failed=kind in ("failed", "gave_up"),
                             meta={"retrying": kind == "failed"}), c.version)
    asyncio.run(main())


def test_a_failed_sample_a_tap_takes_is_counted_as_received():
    """Evaluation's tap (ext/eval.py) takes its samples before the controller adds them: a failed one is
    still counted among the failures received, as the rank that sent it counted it."""
    async def main():
        c = controller()
        c.taps.append(lambda s: asyncio.sleep(0, result=True))        # takes everything
        await c.buffer.transport.put_many("samples", [Sample("t", "g", [], [], [], [], [], 0.0, failed=True,
                                                              meta={"retrying": False})])
        c._begin_step()
        return await c._next_sample(0), c.failed_received
    assert asyncio.run(main()) == (None, 1)


def test_the_failed_samples_of_evaluations_last_round_are_counted_as_received():
    """At the run's end Evaluation.finish (ext/eval.py) takes the last round's samples off the queue itself:
    a failed one there, and a failed training sample it leaves unconsumed, are counted as received too."""
    from ext.eval import Evaluation

    def sample(task_id, eval_, failed):
        return Sample(task_id, task_id.rsplit(".", 1)[0], [], [], [], [], [], 1.0, failed=failed,
                      meta={"retrying": False, "eval": eval_})

    async def main():
        c = controller(version=3)
        ev = Evaluation(c)
        await ev.start([Problem("1+1=", "2")], k=1)                    # tasks eval3.0.greedy, eval3.0.t0
        await c.buffer.transport.put_many("samples", [sample("train.7", False, True),
                                                      sample("eval3.0.greedy", True, True),
                                                      sample("eval3.0.t0", True, False)])
        result = await ev.finish()
        return result, c.failed_received, c.samples_unconsumed
    result, failed, unconsumed = asyncio.run(main())
    assert result == {"eval_version": 3, "eval_greedy": 0.0, "eval_mean_at_1": 1.0}
    assert (failed, unconsumed) == (2, 1)
