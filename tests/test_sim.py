"""tools/sim.py on small settings: it drives the real AsyncController / SampleBuffer / EnvManager / LLMProxy
code in virtual time and its results are sane. Every number here is virtual time; nothing measures wall
time."""

from dataclasses import replace

import pytest

from buffer import Lost
from tools import sim

# 2 rollout engines x 8 slots, 1 trainer GPU, 4 prompts x 4 samples, long-tailed lengths (median 1k, cap 8k)
TINY = sim.SimConfig(rollout_gpus=2, train_gpus=1, batch_groups=4, group_size=4, max_num_seqs=8,
                     len_median=1000, len_sigma=1.0, max_tokens=8192, chunk=128, steps=5, warmup=2,
                     train_tok_s=1000.0)


@pytest.mark.fast
def test_runs_the_real_scheduling_code():
    """Every step's batch comes from AsyncController.collect (whole groups, staleness reported) and every
    sync went through the three phases to every proxy (version and engine weight loads)."""
    r = sim.simulate(replace(TINY, async_ratio=1))
    assert len(r["rows"]) == TINY.steps
    assert all(row["num_samples"] == TINY.batch_groups * TINY.group_size for row in r["rows"])
    assert r["proxy_versions"] == [TINY.steps] * TINY.rollout_gpus
    assert r["engine_loads"] == [TINY.steps] * TINY.rollout_gpus
    assert r["rows"][-1]["tokens_generated"] >= sum(row["tokens"] for row in r["rows"]) * 0.9


@pytest.mark.fast
@pytest.mark.parametrize("alpha", [1, 2])
def test_staleness_never_exceeds_async_ratio_and_efficiency_at_most_one(alpha):
    r = sim.simulate(replace(TINY, async_ratio=alpha))
    assert all(row["staleness_max"] <= alpha for row in r["rows"])
    assert r["staleness_max"] >= 1            # the pipeline did overlap: some batch used older samples
    assert 0 < r["efficiency"] <= 1.02


@pytest.mark.fast
def test_async_beats_sync_on_the_same_split():
    sync = sim.simulate(replace(TINY, async_ratio=0, steps=4, warmup=1))
    asyn = sim.simulate(replace(TINY, async_ratio=2))
    assert sync["staleness_max"] == 0
    assert asyn["samples_per_s"] > 1.2 * sync["samples_per_s"]


@pytest.mark.fast
def test_queue_scheduling_beats_batch_rollout_with_redundant_prompts():
    cfg = sim.colocated(replace(TINY, redundant=4, steps=4), 2)
    batch = sim.simulate(replace(cfg, rollout_mode="batch"))
    queue = sim.simulate(replace(cfg, rollout_mode="queue"))
    assert queue["rollout_s"] < 0.8 * batch["rollout_s"]


@pytest.mark.fast
def test_dynamic_filtering_has_something_to_filter():
    on = sim.simulate(sim.colocated(replace(TINY, steps=3), 2))
    off = sim.simulate(sim.colocated(replace(TINY, steps=3, filter_groups=False), 2))
    assert sum(row["groups_filtered"] for row in on["rows"]) > 0
    assert sum(row["groups_filtered"] for row in off["rows"]) == 0
    assert 0.0 < on["rows"][0]["reward_mean"] < 1.0


@pytest.mark.fast
def test_env_level_async_beats_lockstep_envs():
    agent = sim.colocated(replace(sim.AGENT, batch_groups=4, group_size=4, max_num_seqs=8, turns=3, steps=2,
                                  warmup=1, chunk=32), 2)      # 2 engines x 8 trajectories
    assert agent.max_concurrency == 8
    lock = sim.simulate(replace(agent, lockstep="engine"))
    free = sim.simulate(agent)
    assert all(row["num_samples"] == 16 and row["tokens"] > 0 for row in lock["rows"] + free["rows"])
    assert free["rollout_s"] < 0.9 * lock["rollout_s"]


@pytest.mark.fast
def test_env_failures_are_retried_and_the_run_completes():
    r = sim.simulate(replace(TINY, async_ratio=1, fail_rate=0.1, steps=3, warmup=1))
    assert sum(row["samples_failed"] for row in r["rows"]) > 0
    assert all(row["num_samples"] == TINY.batch_groups * TINY.group_size for row in r["rows"])


@pytest.mark.fast
def test_ideal_bound_is_the_slower_side():
    cfg = replace(TINY, rollout_gpus=64)            # plenty of engines: the trainer is the bottleneck
    gen, per_sample, _ = sim.demand(cfg)
    assert sim.ideal_steps_per_s(cfg) == pytest.approx(
        1 / sim.train_time(cfg, cfg.batch_groups * cfg.group_size * per_sample, cfg.train_gpus))
    assert sim.best_split(TINY, 40) in range(1, 40)


@pytest.mark.fast
def test_configs_that_cannot_be_modelled_are_refused():
    with pytest.raises(ValueError, match="colocated"):
        sim.simulate(replace(TINY, colocated=True, async_ratio=1))
    with pytest.raises(ValueError, match="lockstep"):
        sim.simulate(replace(sim.AGENT, lockstep="engine", env_redundancy=2))


@pytest.mark.fast
def test_workload_lengths_are_correlated_within_a_prompt_and_with_its_difficulty():
    """Samples of one prompt share its length median (the within-prompt spread is smaller than the spread
    over all samples), and harder prompts (lower pass rate) answer longer."""
    import math
    import random
    import statistics
    w = sim.Workload(sim.RLVR)
    rng = random.Random(0)
    logs = {seed: [math.log(w.length(seed, rng)) for _ in range(32)] for seed in range(300)}
    within = statistics.fmean(statistics.pvariance(v) for v in logs.values())
    total = statistics.pvariance([x for v in logs.values() for x in v])
    assert within < 0.75 * total
    p = [w.prompt(seed)[0] for seed in logs]
    med = [statistics.median(v) for v in logs.values()]
    assert statistics.correlation(p, med) < -0.3
    assert len({w.prompt(seed)[2] for seed in logs}) > 3          # prompts have lengths of their own


@pytest.mark.fast
def test_memory_bound_engines_preempt_and_replication_spreads_the_load():
    """Lengths set by the prompt alone (all their spread between prompts) and a KV budget of 3 capped samples
    per engine: with a group's samples on one engine (replication off) the engine holding the long groups runs
    out of KV and preempts; replicated, both engines get half of every group, nothing is preempted, and the
    step's generation ends sooner."""
    cfg = sim.colocated(replace(TINY, kv_tokens=3 * 8192, len_median=2000, len_sigma=1.0,
                                len_sigma_prompt=1.0, len_rho=1.0, filter_groups=False, steps=3), 2)
    off = sim.simulate(replace(cfg, replicate=False))
    on = sim.simulate(replace(cfg, replicate=True))
    assert off["preemptions"] > 0
    assert on["preemptions"] < off["preemptions"]
    assert on["rollout_s"] < 0.95 * off["rollout_s"]
    assert all(row["num_samples"] == 16 for row in off["rows"] + on["rows"])


@pytest.mark.fast
def test_sim_vs_real_fit_recovers_constants_and_never_goes_negative():
    from tools import sim_vs_real
    rows = [(n, c, 0.012 + 0.0005 * n + 1e-6 * n * c) for n in (1, 4, 16, 64) for c in (15, 50)]
    assert sim_vs_real.fit(rows) == pytest.approx((0.012, 0.0005, 1e-6), rel=1e-6)
    rows = [(n, c, 0.01 + 0.001 * n - 1e-6 * n * c) for n in (1, 4, 16, 64) for c in (15, 50)]
    assert min(sim_vs_real.fit(rows)) >= 0


@pytest.mark.parametrize("name", ["queue", "envasync"])
def test_the_committed_table_is_what_the_simulator_prints(name, tmp_path, monkeypatch):
    """results/NAME.md comes from main (`python -m tools.sim all`): the fast experiments run again here
    and print the committed table line for line (the simulator is deterministic; only the real-time
    note in the header may differ)."""
    from pathlib import Path
    monkeypatch.setattr(sim, "RESULTS", tmp_path)
    sim.run_experiment(name, {})
    committed = (Path(__file__).resolve().parent.parent / "results" / f"{name}.md").read_text().splitlines()
    got = (tmp_path / f"{name}.md").read_text().splitlines()
    timeless = lambda lines: [x for x in lines if "s of real time" not in x]
    assert timeless(got) == timeless(committed), f"results/{name}.md is stale: run python -m tools.sim all"


@pytest.mark.fast
def test_weight_sync_time_is_the_models_bytes_over_the_link():
    """One sync = bytes / link bandwidth (broadcast) + bytes / load bandwidth: proportional to the model's
    size, slower across nodes than within one, and what every fake engine of the run sleeps for."""
    one_node = replace(sim.RLVR, rollout_gpus=4, train_gpus=4)
    two_nodes = replace(sim.RLVR, rollout_gpus=8, train_gpus=8)
    bcast, load = sim.weight_sync_s(two_nodes)
    assert sim.model_gb(two_nodes) == pytest.approx(16.4)          # 8.2e9 parameters x 2 bytes (bfloat16)
    assert bcast == pytest.approx(16.4 / sim.INTER_NODE_GB_S)
    assert load == pytest.approx(16.4 / sim.LOAD_GB_S)
    assert sim.weight_sync_s(one_node)[0] == pytest.approx(16.4 / sim.INTRA_NODE_GB_S)
    assert sim.weight_sync_s(one_node)[0] < bcast
    big = sim.weight_sync_s(replace(two_nodes, params=4 * two_nodes.params))            # 32B-class
    assert big == pytest.approx((4 * bcast, 4 * load))
    assert sim.weight_sync_s(replace(two_nodes, dtype="float32")) == pytest.approx((2 * bcast, 2 * load))
    assert sim.weight_sync_s(sim.colocated(sim.RLVR, 16)) == pytest.approx((bcast, load))   # 16 GPUs: 2 nodes
    engine = sim.sim_engine(two_nodes, sim.Workload(two_nodes), seed=0)
    assert engine.load_s == pytest.approx(bcast + load)
    assert "0.66 s across nodes" in sim.sync_note(two_nodes)


# long-tailed lengths (median 2k, sigma 1.3, cap 16k) at ratio 2, 4 x 4 + 2 redundant on 2 engines, 60 steps:
# many tasks outlive alpha versions and are aborted as stale by their rank at a sync
LONG_TAIL = sim.SimConfig(rollout_gpus=2, train_gpus=2, batch_groups=4, group_size=4, redundant=2,
                          async_ratio=2, len_median=2000, len_sigma=1.3, max_tokens=16384, steps=60)


@pytest.mark.parametrize("replicate", [False, True])
def test_every_admitted_group_ends_in_a_state_the_controller_learns_of(replicate, monkeypatch):
    """A group whose work a rollout rank aborts as stale must free its admission place: after every step,
    each group the controller counts as alive still has work somewhere (a queued or running task, a sample
    on its way or pending), the books balance (admitted = trained + filtered + lost + alive), and the
    rollout wait of the late steps does not drift up as it did while such groups piled up to alpha x B + R."""
    managers = []

    class Recorded(sim.EnvManager):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            managers.append(self)
    monkeypatch.setattr(sim, "EnvManager", Recorded)
    leaked = []

    def observe(ctrl, step):
        work = ({t.group_id for m in managers for t, _ in m.jobs.values()}
                | {t.group_id for m in managers for t in m.held}
                | {s.group_id for m in managers for s in m.outbox}
                | {t.group_id for t in ctrl.buffer.transport.queues["tasks"].items}
                | {s.group_id for s in ctrl.buffer.transport.queues["samples"].items}
                | set(ctrl.assembler.pending)
                | {g[0].group_id for g in ctrl.assembler.ready})
        leaked.append(len(set(ctrl.problem_of) - work))
        ended = ctrl.groups_taken + ctrl._groups_ended_untrained()
        assert ctrl.groups_admitted == ended + len(ctrl.problem_of)
    r = sim.simulate(replace(LONG_TAIL, replicate=replicate), observe=observe)
    assert sum(m.counters["aborted_stale"] for m in managers) > 0      # the case at hand did happen
    assert leaked == [0] * LONG_TAIL.steps
    wait = [row["time_wait_rollout"] for row in r["rows"]]
    early, late = sum(wait[2:20]) / 18, sum(wait[30:60]) / 30
    assert late < 1.2 * early, (early, late)


def test_batch_rollout_runs_one_round_a_step_when_filtering_leaves_a_batch():
    """The barrier baseline launches B + R prompts and waits for all of them; it starts another round only
    when dynamic filtering left fewer than B groups, so its step admits B + R groups when enough survive."""
    admitted, short = [], []

    def observe(ctrl, step):
        admitted.append(ctrl.groups_admitted - sum(admitted))
        short.append(step.info["groups_filtered"] > 16)          # more than R filtered: a second round is due
    cfg = sim.colocated(replace(sim.RLVR, batch_groups=8, group_size=8, redundant=16, rollout_mode="batch",
                                steps=6), 8)
    sim.simulate(cfg, observe=observe)
    assert not any(short)                                        # (this workload filters ~5 of 24 a step)
    assert admitted == [24] * 6


def holding_bound_recorder(held: list, queued: list | None = None):
    """setup(ctrl) for sim.simulate: after every admission, the groups holding places (admitted, neither lost
    nor trained by an earlier step) into held, and the tasks queued into queued."""
    def setup(ctrl):
        admit = ctrl.admit

        async def admit_and_count(at_least=0):
            n = await admit(at_least)
            a = ctrl.assembler
            lost = a.groups_filtered + sum(getattr(a, f"groups_{why}") for why in Lost)
            held.append(ctrl.groups_admitted - lost - ctrl.taken_before_step)
            if queued is not None:
                queued.append(ctrl.buffer.num_queued_tasks())
            return n
        ctrl.admit = admit_and_count
    return setup


@pytest.mark.parametrize("alpha", [0, 1])
def test_short_steps_keep_the_admission_bound(alpha):
    """--max-gen-batches 1 --on-max-gen-batches train: most steps end short of B groups (dynamic filtering
    drops ~22% of them). Over 40 steps the groups holding places (admitted, neither lost nor trained by an
    earlier step) never exceed (alpha + 1) * B + redundant after any admission, the task queue stays within
    that many groups' tasks, and every short step completed its --max-gen-batches batches of groups itself
    (ready groups carried over from an earlier step do not end it)."""
    B, G, R = 8, 8, 2
    cfg = replace(TINY, batch_groups=B, group_size=G, redundant=R, async_ratio=alpha, max_gen_batches=1,
                  on_max_gen_batches="train", steps=40, warmup=1, len_median=400, chunk=256)
    bound, held, queued = (alpha + 1) * B + R, [], []
    r = sim.simulate(cfg, setup=holding_bound_recorder(held, queued))
    short = [row for row in r["rows"] if row["num_samples"] < B * G]
    assert len(short) >= 10                      # the bound is exercised: many steps trained fewer groups
    assert max(held) <= bound, (max(held), bound)
    assert max(queued) <= bound * G
    assert all(row["groups_completed"] >= B for row in short)
    assert all(row["staleness_max"] <= alpha for row in r["rows"])


@pytest.mark.fast
def test_a_resumed_run_continues_the_one_it_resumes():
    """A run checkpointed at step 4 (AsyncController.state(), as train.py saves it) and resumed from it
    (restore(), the stream from the saved data position, the checkpoint's version) continues that run: its
    group ids go on, so no game's env seed is played again; every problem of the stream is admitted, none
    skipped, and none is trained twice across the two runs (the prompts in flight at the save run first after
    it); the staleness bound holds from the first step after the resume."""
    import itertools

    from rollout import env_seed
    from task import Problem
    cfg = replace(TINY, batch_groups=4, group_size=4, redundant=2, async_ratio=2, prompt_seeds=True, warmup=1)

    def stream(start):       # unique problems, by position (as task.problem_stream's for a resume)
        return (Problem(f"q{i}", "", meta={"sim_seed": i}) for i in itertools.count(start))

    def run(steps, state=None, version=0):
        admitted, trained = {}, []                 # group id -> its problem's prompt; trained prompts

        def setup(ctrl):
            if state is not None:
                ctrl.restore(state)
            admit = ctrl.admit

            async def admit_and_record(at_least=0):
                n = await admit(at_least)
                admitted.update((g, p.prompt) for g, p in ctrl.problem_of.items())
                return n
            ctrl.admit = admit_and_record
        saved = {}

        def observe(ctrl, step):                   # each step's groups; the state train.py would save
            trained.extend(admitted[g] for g in {x.group_id for x in step.batch})
            saved.update(ctrl.state())
        r = sim.simulate(replace(cfg, steps=steps, start_version=version), setup=setup, observe=observe,
                         problems=stream(state["data_position"] if state else 0))
        return r, admitted, trained, saved
    _, admitted1, trained1, state = run(4)
    r2, admitted2, trained2, end = run(4, state, version=4)
    assert min(int(g[1:]) for g in admitted2) == state["next_group"] == len(admitted1)
    assert not {env_seed(g) for g in admitted1} & {env_seed(g) for g in admitted2}
    in_flight = [p["prompt"] for p in state["admission"]["in_flight"]]
    assert in_flight and set(in_flight) <= set(admitted2.values())
    drawn = end["data_position"]
    assert sorted(set(admitted1.values()) | set(admitted2.values()), key=lambda q: int(q[1:])) == \
        [f"q{i}" for i in range(drawn)]                                     # none skipped
    assert len(trained1 + trained2) == len(set(trained1 + trained2))       # none trained twice
    assert all(row["staleness_max"] <= cfg.async_ratio for row in r2["rows"])


@pytest.mark.fast
def test_the_freshness_rule_travels_with_sync_and_a_step_that_drops_many_stale_samples_warns_once():
    """A rule stricter than its max_lag admits for (max_lag 2, but only samples of the trainer's own version
    are fresh): the assembler drops what fails it, every SYNC carries it to the rollout ranks, which abort
    their running work that fails it (tokens thrown away; none under the async ratio's own rule at these
    settings), and the controller warns once, naming the rule and the flags."""
    from buffer import Freshness

    class OnlyCurrent(Freshness):
        def fresh(self, oldest_version, version, group_id=""):
            return oldest_version >= version

    def run(rule):
        logs = []

        def setup(ctrl):
            ctrl.log = logs.append
            if rule is not None:
                ctrl.freshness = rule
        r = sim.simulate(replace(TINY, async_ratio=2, steps=6), setup=setup)
        return r, logs
    strict, logs = run(OnlyCurrent(2))
    default, quiet = run(None)
    assert strict["rows"][-1]["tokens_aborted"] > 0 == default["rows"][-1]["tokens_aborted"]
    assert sum(row["samples_dropped_stale"] for row in strict["rows"]) > 0
    [warning] = [x for x in logs if "dropped as stale" in x]
    assert "OnlyCurrent (max lag 2 versions; --async-ratio)" in warning and "--batch-groups" in warning
    assert not [x for x in quiet if "dropped as stale" in x]
