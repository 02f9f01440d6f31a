"""buffer.py: the freshness rule, group assembly and the transports."""

import asyncio
import time

import pytest
from hypothesis import given, settings, strategies as st

from buffer import (ORDERS, Cmd, Command, GroupAssembler, LocalQueues, Lost, ManagerQueues, RolloutTask,
                    Sample, SampleBuffer, Freshness)
from task import Problem

pytestmark = pytest.mark.fast


def sample(gid: str, versions: list[int], reward: float = 0.0, failed: bool = False, i: int = 0) -> Sample:
    return Sample(f"{gid}.{i}", gid, [1], [2] * len(versions), [-1.0] * len(versions), [1] * len(versions),
                  versions, reward, failed=failed)


def test_fresh_rule():
    fresh = lambda oldest, version, alpha: Freshness(alpha).fresh(oldest, version)   # noqa: E731
    assert fresh(3, 5, 2) and not fresh(2, 5, 2) and fresh(5, 5, 0) and not fresh(4, 5, 0)
    assert Freshness.of(3).max_lag == 3 and Freshness.of(rule := Freshness(1)) is rule


# one operation of an interleaving: ("put", group, oldest version offset, reward) | ("bump",) | ("take", n)
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 5), st.integers(0, 4), st.integers(0, 1), st.booleans()),
    st.tuples(st.just("bump")),
    st.tuples(st.just("take"), st.integers(1, 3)),
    st.tuples(st.just("defer"), st.integers(0, 5)),
    st.tuples(st.just("give up"), st.integers(0, 5), st.sampled_from(["", *Lost])),
), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops=ops, async_ratio=st.integers(0, 3), group_size=st.integers(1, 3), order=st.sampled_from(ORDERS),
       extra=st.integers(0, 2))
def test_property_no_stale_sample_returned_and_all_drops_counted(ops, async_ratio, group_size, order, extra):
    asm = GroupAssembler(group_size, async_ratio, order=order)
    for g in range(6):
        asm.expect(f"g{g}", group_size + extra)      # redundancy: the first group_size to arrive make it
    version, added, returned = 0, 0, 0
    for op in ops:
        if op[0] == "give up":                       # a sample that never comes: failed, or a rank's notice
            s = sample(f"g{op[1]}", [version], failed=True, i=added)
            s.meta.update(retrying=False, **({"aborted": op[2]} if op[2] else {}))
            asm.add(s, version)
            added += 1
        elif op[0] == "put":
            _, g, lag, reward, failed = op
            # a sample's oldest version is at most the current version (tokens can't come from the future)
            asm.add(sample(f"g{g}", [max(0, version - lag), version], float(reward), failed, added), version)
            added += 1
        elif op[0] == "bump":
            version += 1
            asm.evict_stale(version)
        elif op[0] == "defer":           # tail batching gives up on a group that is not complete
            g = f"g{op[1]}"
            if g not in asm.closed and g not in asm.dead:
                asm.defer(g, version)
        else:
            for group in asm.take(op[1], version):
                assert len(group) == group_size and len({s.group_id for s in group}) == 1
                for s in group:
                    assert s.oldest_version >= version - async_ratio, \
                        "returned a sample violating the async ratio"
                    assert not s.failed
                if group_size > 1:
                    assert len({s.reward for s in group}) > 1, "an all-equal group reached training"
                returned += len(group)
    held = sum(len(g) for g in asm.pending.values()) + sum(len(g) for g in asm.ready)
    counted = (asm.samples_dropped_stale + asm.groups_filtered * asm.group_size + asm.samples_failed
               + asm.samples_surplus + asm.samples_deferred + asm.samples_interrupted)
    assert added == returned + held + counted, "a sample vanished without being counted"


def test_sample_order_oldest_or_freshest_first():
    """Groups complete with oldest versions 1, 3, 2 (trainer at version 3, ratio 2): oldest-first
    hands them out in completion order, freshest-first by version, newest first."""
    def taken(order):
        asm = GroupAssembler(group_size=2, freshness=2, order=order)
        for gid, v in (("a", 1), ("b", 3), ("c", 2), ("d", 3)):
            asm.add(sample(gid, [v], 0.0, i=0), 3)
            asm.add(sample(gid, [v], 1.0, i=1), 3)
        return [g[0].group_id for g in asm.take(4, 3)]
    assert taken("oldest") == ["a", "b", "c", "d"]
    assert taken("freshest") == ["b", "d", "c", "a"]
    with pytest.raises(ValueError, match="--sample-order"):
        GroupAssembler(2, 2, order="newest")


def test_group_assembly_filter_stale_and_surplus():
    asm = GroupAssembler(group_size=2, freshness=1)
    asm.add(sample("a", [0], 1.0), 0)
    asm.add(sample("a", [0], 1.0), 0)          # all equal: filtered
    assert asm.groups_filtered == 1 and asm.num_ready() == 0
    asm.add(sample("b", [0], 1.0), 0)
    asm.add(sample("b", [0], 0.0), 0)
    asm.add(sample("b", [0], 0.0), 0)          # redundant third sample: surplus
    assert asm.num_ready() == 1 and asm.samples_surplus == 1
    asm.add(sample("c", [0], 1.0), 0)          # pending, will go stale
    assert asm.evict_stale(2) == ["c", "b"]    # both hold version-0 samples, stale at version 2 with ratio 1
    assert asm.take(5, 2) == [] and asm.samples_dropped_stale == 3
    asm.add(sample("c", [2], 0.0), 2)          # late sample of a dropped group: counted, not kept
    assert asm.samples_dropped_stale == 4 and not asm.pending


def test_local_queues_buffer_roundtrip_and_timeout():
    async def main():
        b = SampleBuffer(LocalQueues(num_ranks=2), who="test rank", timeout_s=0.05)
        await b.put_tasks([RolloutTask("t0", "g0", Problem("1+1=", "2"))])
        assert [t.task_id for t in b.transport.get_many_nowait("tasks", 5)] == ["t0"]
        assert b.transport.get_many_nowait("tasks", 5) == []
        await b.send_command(1, Command(Cmd.STOP))
        assert b.transport.get_many_nowait("commands", 1, 0) == [] and \
            b.transport.get_many_nowait("commands", 1, 1) == [Command(Cmd.STOP)]
        with pytest.raises(TimeoutError, match="test rank.*samples"):
            await b.get_sample()
    asyncio.run(main())


def test_manager_queues_over_tcp():
    """The real transport: a manager process serving the queues on localhost with an authkey."""
    port = free_port()
    server = ManagerQueues.serve("127.0.0.1", port, b"secret", num_ranks=1)
    try:
        client = ManagerQueues.connect("127.0.0.1", port, b"secret", num_ranks=1, timeout_s=10)

        async def main():
            b_srv, b_cli = SampleBuffer(server, "server"), SampleBuffer(client, "client")
            await b_srv.put_tasks([RolloutTask("t1", "g1", Problem("2+2=", "4"))])
            for _ in range(500):              # the task crosses the TCP connection: poll, up to 5 s
                if got := b_cli.transport.get_many_nowait("tasks", 1):
                    break
                await asyncio.sleep(0.01)
            t = got[0]
            await b_cli.put_samples([sample("g1", [0, 1], 1.0)])
            s = await b_srv.get_sample(timeout=5)
            return t, s
        t, s = asyncio.run(main())
        assert t.problem.answer == "4" and s.oldest_version == 0 and s.reward == 1.0
        with pytest.raises(Exception):
            ManagerQueues.connect("127.0.0.1", port, b"wrong-key", num_ranks=1, timeout_s=2)
    finally:
        server.shutdown()


def free_port() -> int:
    import socket
    with socket.socket() as sock:          # a free port on loopback
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_exchange_is_a_rollout_ranks_tick_in_one_call(transport):
    """exchange: the samples go out; the rank's own next command (one, in order) and up to max_tasks
    tasks come back, with how many were queued before the take."""
    port = free_port()
    tcp = transport == "tcp"
    server = ManagerQueues.serve("127.0.0.1", port, b"k", num_ranks=2) if tcp else LocalQueues(2)
    client = ManagerQueues.connect("127.0.0.1", port, b"k", num_ranks=2, timeout_s=10) if tcp else server
    try:
        async def main():
            b_srv = SampleBuffer(server, "server", timeout_s=10)
            b_cli = SampleBuffer(client, "rollout rank 1")
            await b_srv.put_tasks([RolloutTask(f"t{i}", f"g{i}", Problem("1+1=", "2")) for i in range(5)])
            await b_srv.send_command(1, Command(Cmd.SYNC, version=3))
            await b_srv.send_command(1, Command(Cmd.STOP))
            await b_srv.send_command(0, Command(Cmd.STOP))          # another rank's: never rank 1's
            cmd, tasks, queued = await b_cli.exchange(1, [sample("g9", [0], 1.0)], True, 2)
            assert (cmd.kind, cmd.version, queued) == (Cmd.SYNC, 3, 5)
            assert [t.task_id for t in tasks] == ["t0", "t1"]
            assert (await b_srv.get_sample(timeout=5)).reward == 1.0
            cmd, tasks, queued = await b_cli.exchange(1, [], False, 8)   # a sync in flight: no command
            assert (cmd, [t.task_id for t in tasks], queued) == (None, ["t2", "t3", "t4"], 3)
            assert await b_cli.exchange(1, [], True, 8) == (Command(Cmd.STOP), [], 0)
            assert await b_cli.exchange(1, [], True, 8) == (None, [], 0)
            assert b_srv.transport.get_many_nowait("commands", 1, 0) == [Command(Cmd.STOP)]
            # tasks a rank passed over go back to the front, in their order, before those queued since
            await b_srv.put_tasks([RolloutTask("t5", "g5", Problem("1+1=", "2"))])
            await b_cli.return_tasks(tasks[1:])
            assert [t.task_id for t in b_cli.transport.get_many_nowait("tasks", 8)] == ["t3", "t4", "t5"]
        asyncio.run(main())
    finally:
        if tcp:
            server.shutdown()


def test_a_sample_given_up_on_kills_its_group():
    """After its last retry fails, a sample never comes: its group must not stay pending forever."""
    asm = GroupAssembler(group_size=3, freshness=1)
    asm.add(sample("a", [0], 1.0, i=0), 0)
    s = sample("a", [0], failed=True, i=1)
    s.meta["retrying"] = True
    asm.add(s, 0)                                  # will be retried: the group waits
    assert "a" in asm.pending and asm.groups_failed == 0
    s = sample("a", [0], failed=True, i=2)
    s.meta["retrying"] = False
    asm.add(s, 0)                                  # given up: the group is lost, and counted
    assert "a" not in asm.pending and asm.groups_failed == 1 and asm.samples_failed == 3
    asm.add(sample("a", [0], 0.0, i=3), 0)         # a straggler of the lost group is dropped
    assert not asm.pending and not asm.ready


def test_with_redundancy_a_group_dies_only_when_it_can_no_longer_reach_group_size():
    """--env-redundancy runs G + R trajectories of a group: one given up on leaves it alive while G can still
    arrive; once too few can, the group is lost as failed, and a later good sample of it is counted with
    that reason (not as stale)."""
    def given_up(gid, i):
        s = sample(gid, [0], failed=True, i=i)
        s.meta["retrying"] = False
        return s
    asm = GroupAssembler(group_size=2, freshness=1)
    asm.expect("a", 4)
    asm.add(given_up("a", 0), 0)
    asm.add(given_up("a", 1), 0)                   # 2 of 4 can still arrive: alive
    asm.add(sample("a", [0], 1.0, i=2), 0)
    asm.add(sample("a", [0], 0.0, i=3), 0)
    assert [g[0].group_id for g in asm.take(1, 0)] == ["a"] and asm.groups_failed == 0
    asm.expect("b", 3)
    asm.add(sample("b", [0], 1.0, i=0), 0)
    asm.add(given_up("b", 1), 0)
    assert "b" in asm.pending
    asm.add(given_up("b", 2), 0)                   # 1 of 3 left: lost as failed, with its held sample
    asm.add(sample("b", [0], 0.0, i=3), 0)         # a straggler: counted for the group's reason
    assert asm.lost["b"] == Lost.FAILED and asm.groups_failed == 1 and asm.samples_failed == 6
    assert asm.samples_dropped_stale == 0 and asm.groups_dropped_stale == 0 and not asm.pending


def test_a_ranks_abort_notice_loses_the_group_for_its_reason():
    """A rank that aborts a task as stale (or a sleep ends it) sends a notice; the group is lost for that
    reason, counted once, and its place can be freed."""
    asm = GroupAssembler(group_size=2, freshness=1)
    for gid, why in (("a", Lost.STALE), ("b", Lost.INTERRUPTED)):
        s = sample(gid, [0], failed=True)
        s.meta.update(retrying=False, aborted=str(why))
        asm.add(s, 1)
        assert asm.lost[gid] == why
    assert (asm.groups_dropped_stale, asm.groups_interrupted, asm.groups_failed) == (1, 1, 0)
    assert (asm.samples_dropped_stale, asm.samples_interrupted, asm.samples_failed) == (1, 1, 0)


def test_assembler_memory_stays_bounded_on_a_long_run():
    """1000 versions of 4 groups each (some filtered, some stale): the ids the assembler remembers
    stop growing, and a straggler of a long-forgotten group is still counted (as stale)."""
    asm = GroupAssembler(group_size=2, freshness=1)
    sizes = []
    for v in range(1000):
        for g in range(4):
            gid = f"g{v}.{g}"
            lag = 3 if g == 3 else 0                           # one group a version arrives stale
            asm.add(sample(gid, [v - lag], 0.0, i=0), v)
            asm.add(sample(gid, [v - lag], float(g % 2), i=1), v)   # g0, g2 filtered; g1 ready
        asm.take(4, v)
        asm.evict_stale(v + 1)
        sizes.append(len(asm.closed) + len(asm.dead) + len(asm.resolved) + len(asm.resolved_at))
    assert max(sizes[500:]) == max(sizes[100:200]) < 200
    before = asm.samples_dropped_stale
    asm.add(sample("g3.1", [3], 1.0, i=2), 1000)              # its group closed 997 versions ago
    assert asm.samples_dropped_stale == before + 1 and not asm.pending


def test_a_rollout_ranks_polls_do_not_stop_its_event_loop():
    """Against the trainer's queue server every call is a round trip; the rollout rank polls commands and
    tasks from its event loop, which must go on meanwhile (the engine's outputs, the trajectories)."""
    class SlowServer(LocalQueues):          # a transport whose calls wait 0.3 s for a server
        round_trips = True

        def get_many_nowait(self, *args, **kwargs):
            time.sleep(0.3)
            return super().get_many_nowait(*args, **kwargs)

    async def main():
        buf = SampleBuffer(SlowServer(1), "rollout rank 0")
        ticks = 0

        async def other_work():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        work = asyncio.create_task(other_work())
        assert await buf.exchange(0, [], True, 4) == (None, [], 0) and await buf.poll_tasks(4) == []
        work.cancel()
        return ticks
    assert asyncio.run(main()) >= 10        # ~90 ticks in the 0.9 s of round trips; 0 when they block
