"""ext/tail_batching.py through the real controller, buffer and env managers on fake engines (tools/sim.py,
virtual time):
short and long rounds, no prompt lost, nothing stale at ratio 0, the long queue across a resume."""

from dataclasses import replace

import pytest

from types import SimpleNamespace

from controller import ControllerConfig
from ext.tail_batching import Round, TailBatching, TailBatchingExt, TailConfig
from task import Problem
from tools import sim

# 2 engines x 8 slots, 4 prompts x 4 samples, long-tailed lengths keyed by the prompt (a prompt run again
# in a long round is the same prompt)
TINY = sim.SimConfig(rollout_gpus=2, train_gpus=1, batch_groups=4, group_size=4, max_num_seqs=8,
                     len_median=1000, len_sigma=1.0, max_tokens=8192, chunk=128, steps=12, warmup=2,
                     train_tok_s=1000.0, prompt_seeds=True, tail_batching=True, async_ratio=0)


class Ledger:
    """Every prompt's fate, by identity (prompts are unique): admitted under which groups, trained in
    which step and round."""

    def __init__(self):
        self.gid_prompt: dict[str, str] = {}
        self.trained: list[tuple[str, int, str]] = []        # (prompt, step, round)

    def setup(self, ctrl):
        put = ctrl.buffer.put_tasks

        async def put_tasks(tasks):
            for t in tasks:
                self.gid_prompt[t.group_id] = t.problem.prompt
            await put(tasks)
        ctrl.buffer.put_tasks = put_tasks

    def observe(self, ctrl, step):
        gids = dict.fromkeys(s.group_id for s in step.batch)
        self.trained += [(self.gid_prompt[g], ctrl.version, step.info["round"]) for g in gids]


def run(cfg, ledger, problems=None, setup=None):
    def both(ctrl):
        ledger.setup(ctrl)
        if setup is not None:
            setup(ctrl)
    state = {}

    def observe(ctrl, step):
        ledger.observe(ctrl, step)
        state.update(ctrl=ctrl)
    r = sim.simulate(cfg, problems, observe, both)
    return r, state["ctrl"]


def check_every_prompt_accounted(ctrl, ledger):
    """Each prompt drawn is trained once, or lost with its reason (filtered, failed, stale, a long round
    that overran alpha), or still waiting (in flight, re-admission, the long queue): never two of these."""
    trained = [p for p, _, _ in ledger.trained]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    kept = ctrl.admission.state(ctrl)
    waiting = [p.prompt for p in kept["in_flight"] + kept["long_queue"]]
    assert len(waiting) == len(set(waiting)) and not set(waiting) & set(trained)
    asm, tb = ctrl.assembler, ctrl.admission
    lost = asm.groups_filtered + asm.groups_failed + asm.groups_dropped_stale + tb.long_dropped
    assert ctrl.groups_drawn == len(trained) + lost + len(waiting)
    assert asm.groups_deferred == tb.deferred + tb.long_dropped     # (both given up on by defer())


@pytest.mark.parametrize("stream", [False, True])
def test_short_rounds_defer_the_tail_and_long_rounds_train_it_at_ratio_0(stream):
    """At ratio 0 every step is on-policy (staleness 0). Short rounds over-sample 1.5x and move what is not
    done when the batch is full to the long queue; when it holds a batch, the next step is a long round
    of exactly those prompts. Some generated tokens are thrown away by the aborts, and no prompt is lost."""
    ledger = Ledger()
    r, ctrl = run(replace(TINY, stream_train=stream), ledger)
    rows = r["rows"]
    assert all(row["staleness_max"] == 0 and row["num_samples"] == 16 for row in rows)
    kinds = [row["round"] for row in rows]
    assert kinds.count("long") >= 2 and kinds.count("short") >= 4
    for prev, row in zip(rows, rows[1:]):          # a long round once the queue holds a batch, and only then
        assert (row["round"] == "long") == (prev["long_queue"] >= TINY.batch_groups)
    for row in rows:
        if row["round"] == "long":
            assert row["groups_long_trained"] == 4 and row["prompts_deferred"] == 0
        else:
            assert row["groups_long_trained"] == 0
    assert sum(row["prompts_deferred"] for row in rows) > 0 and 0 < r["aborted_share"] < 0.5
    # a deferred prompt comes back in a long round: the same prompt, trained once
    long_trained = {p for p, _, kind in ledger.trained if kind == "long"}
    assert len(long_trained) >= 8
    check_every_prompt_accounted(ctrl, ledger)


def test_tail_batching_at_ratio_2_keeps_the_bound_and_every_prompt():
    ledger = Ledger()
    r, ctrl = run(replace(TINY, async_ratio=2, steps=16), ledger)
    assert all(row["staleness_max"] <= 2 for row in r["rows"])
    assert sum(row["prompts_deferred"] for row in r["rows"]) > 0
    assert "long" in [row["round"] for row in r["rows"]]
    check_every_prompt_accounted(ctrl, ledger)


def test_the_long_queue_survives_a_resume():
    """A run stops with prompts in its long queue (and in flight); a new controller that starts from
    what a checkpoint keeps (Admission.state: in flight, the long queue) trains each of them once, the long
    queue's in a long round, and draws only new prompts from the stream."""
    first = Ledger()
    stream = sim.sim_problems(TINY)
    cfg = replace(TINY, steps=4)               # short, short, long, short: the queue holds 2 at the end
    _, ctrl = run(cfg, first, stream)
    kept = ctrl.admission.state(ctrl)
    long = [p.prompt for p in kept["long_queue"]]
    in_flight = kept["in_flight"]
    assert long, "the run ended with an empty long queue: nothing to carry over"
    saved_long = [Problem(**vars(p)) for p in kept["long_queue"]]    # (as the checkpoint's JSON)

    def restore(c):
        c.admission.restore(c, {"in_flight": in_flight, "long_queue": saved_long})
    second = Ledger()
    _, ctrl2 = run(replace(TINY, steps=8), second, stream, restore)
    trained_before = {p for p, _, _ in first.trained}
    trained_after = {p: kind for p, _, kind in second.trained}
    assert not trained_before & set(trained_after)                     # nothing trained again
    kept2 = ctrl2.admission.state(ctrl2)
    waiting = {q.prompt for q in kept2["in_flight"] + kept2["long_queue"]}
    filtered = {second.gid_prompt[g] for g in ctrl2.assembler.closed} - set(trained_after)
    for p in long:         # trained in a long round, or filtered there (all rewards equal), or still queued
        assert trained_after.get(p) == "long" or p in filtered or p in waiting, p
    assert sum(trained_after.get(p) == "long" for p in long) >= 1
    asm = ctrl2.assembler
    lost = asm.groups_filtered + asm.groups_failed + asm.groups_dropped_stale
    assert ctrl2.groups_drawn + len(in_flight) + len(long) == len(trained_after) + lost + len(waiting)


def test_round_state_machine_and_flags():
    cfg = ControllerConfig(batch_groups=4, group_size=8, async_ratio=0, redundant=1)
    tb = TailBatching(cfg, oversample=1.5, extra_samples=2)
    assert tb.begin_step(None) == 0 and tb.round == Round.SHORT and tb.target() == 4 + 2 + 1   # (no block)
    assert tb.admitted("a", 0) == 10                                       # samples per group: 8 + 2
    assert tb.overdue(0, ["a"]) == ["a"] and tb.give_up("a", Problem("p", "1")) and len(tb.long_queue) == 1
    tb.long_queue.extend(Problem(f"q{i}", "1") for i in range(3))
    assert tb.begin_step(None) == 4 and tb.round == Round.LONG and tb.target() == 4     # the long block: 4
    assert tb.next_problem().prompt == "p"
    assert tb.admitted("b", 3) == 8                                        # no over-sampling in a long round
    assert not tb.give_up("b", Problem("q", "1")) and tb.long_dropped == 1    # a long group is not deferred
    alpha2 = TailBatching(ControllerConfig(batch_groups=4, async_ratio=2), oversample=1.5, extra_samples=0)
    alpha2.admitted("old", 3)
    alpha2.admitted("new", 4)
    assert alpha2.overdue(5, ["old", "new"]) == ["old"]                # admitted alpha or more versions ago
    with pytest.raises(ValueError, match="--tail-oversample"):
        TailConfig(tail_oversample=0.5)
    with pytest.raises(ValueError, match="--rollout-mode queue"):
        TailBatchingExt.configure(SimpleNamespace(controller=ControllerConfig(rollout_mode="batch")),
                                  TailConfig(tail_batching=True))


def test_tail_batching_off_leaves_the_schedule_as_it_was():
    """The default: no rounds reported, and the same steps as before (the committed tables' check,
    tests/test_sim.py, covers the numbers)."""
    r = sim.simulate(replace(TINY, tail_batching=False, steps=4, warmup=1))
    assert all("round" not in row and row["tokens_aborted"] == 0 for row in r["rows"])


def test_extra_samples_per_prompt_keep_the_first_group_size_and_abort_the_rest():
    ledger = Ledger()
    r, ctrl = run(replace(TINY, tail_extra_samples=2, steps=6), ledger)
    assert all(row["num_samples"] == 16 and row["staleness_max"] == 0 for row in r["rows"])
    assert ctrl.assembler.samples_surplus + r["rows"][-1]["tokens_aborted"] > 0
    check_every_prompt_accounted(ctrl, ledger)


