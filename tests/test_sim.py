"""sim.py on small settings: it drives the real AsyncController / SampleBuffer / EnvManager / LLMProxy code in
virtual time and its results are sane. Every number here is virtual time; nothing measures wall time."""

from dataclasses import replace

import pytest

import sim

# 2 rollout engines x 8 slots, 1 trainer GPU, 4 prompts x 4 samples, long-tailed lengths (median 1k, cap 8k)
TINY = sim.SimConfig(rollout_gpus=2, train_gpus=1, batch_groups=4, group_size=4, max_num_seqs=8,
                     len_median=1000, len_sigma=1.0, max_tokens=8192, chunk=128, steps=5, warmup=2,
                     train_tok_s=1000.0)


def test_runs_the_real_scheduling_code():
    """Every step's batch comes from AsyncController.collect (whole groups, staleness reported) and every
    sync went through the three phases to every proxy (version and engine weight loads)."""
    r = sim.simulate(replace(TINY, async_ratio=1))
    assert len(r["rows"]) == TINY.steps
    assert all(row["num_samples"] == TINY.batch_groups * TINY.group_size for row in r["rows"])
    assert r["proxy_versions"] == [TINY.steps] * TINY.rollout_gpus
    assert r["engine_loads"] == [TINY.steps] * TINY.rollout_gpus
    assert r["rows"][-1]["tokens_generated"] >= sum(row["tokens"] for row in r["rows"]) * 0.9


@pytest.mark.parametrize("alpha", [1, 2])
def test_staleness_never_exceeds_async_ratio_and_efficiency_at_most_one(alpha):
    r = sim.simulate(replace(TINY, async_ratio=alpha))
    assert all(row["staleness_max"] <= alpha for row in r["rows"])
    assert r["staleness_max"] >= 1            # the pipeline did overlap: some batch used older samples
    assert 0 < r["efficiency"] <= 1.02


def test_async_beats_sync_on_the_same_split():
    sync = sim.simulate(replace(TINY, async_ratio=0, steps=4, warmup=1))
    asyn = sim.simulate(replace(TINY, async_ratio=2))
    assert sync["staleness_max"] == 0
    assert asyn["samples_per_s"] > 1.2 * sync["samples_per_s"]


def test_queue_scheduling_beats_batch_rollout_with_redundant_prompts():
    cfg = sim.colocated(replace(TINY, redundant=4, steps=4), 2)
    batch = sim.simulate(replace(cfg, rollout_mode="batch"))
    queue = sim.simulate(replace(cfg, rollout_mode="queue"))
    assert queue["rollout_s"] < 0.8 * batch["rollout_s"]


def test_dynamic_filtering_has_something_to_filter():
    on = sim.simulate(sim.colocated(replace(TINY, steps=3), 2))
    off = sim.simulate(sim.colocated(replace(TINY, steps=3, filter_equal=False), 2))
    assert sum(row["groups_filtered"] for row in on["rows"]) > 0
    assert sum(row["groups_filtered"] for row in off["rows"]) == 0
    assert 0.0 < on["rows"][0]["reward_mean"] < 1.0


def test_env_level_async_beats_lockstep_envs():
    agent = sim.colocated(replace(sim.AGENT, batch_groups=4, group_size=4, max_num_seqs=8, turns=3, steps=2,
                                  warmup=1, chunk=32), 2)      # 2 engines x 8 trajectories
    assert agent.max_concurrency == 8
    lock = sim.simulate(replace(agent, lockstep="engine"))
    free = sim.simulate(agent)
    assert all(row["num_samples"] == 16 and row["tokens"] > 0 for row in lock["rows"] + free["rows"])
    assert free["rollout_s"] < 0.9 * lock["rollout_s"]


def test_env_failures_are_retried_and_the_run_completes():
    r = sim.simulate(replace(TINY, async_ratio=1, fail_rate=0.1, steps=3, warmup=1))
    assert sum(row["samples_failed"] for row in r["rows"]) > 0
    assert all(row["num_samples"] == TINY.batch_groups * TINY.group_size for row in r["rows"])


def test_ideal_bound_is_the_slower_side():
    cfg = replace(TINY, rollout_gpus=64)            # plenty of engines: the trainer is the bottleneck
    gen, per_sample, _ = sim.demand(cfg)
    assert sim.ideal_steps_per_s(cfg) == pytest.approx(
        1 / sim.train_time(cfg, cfg.batch_groups * cfg.group_size * per_sample, cfg.train_gpus))
    assert sim.best_split(TINY, 40) in range(1, 40)


def test_configs_that_cannot_be_modelled_are_refused():
    with pytest.raises(ValueError, match="colocated"):
        sim.simulate(replace(TINY, colocated=True, async_ratio=1))
    with pytest.raises(ValueError, match="lockstep"):
        sim.simulate(replace(sim.AGENT, lockstep="engine", env_redundancy=2))
