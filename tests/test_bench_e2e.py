"""tools/bench_e2e.py's baselines. The lockstep loop, the baseline the agentic benchmark compares the system
with, must really be lockstep (a turn starts only once every env call of the turn before returned), or its
ratios mean nothing: in fast-forwarded virtual time (looptime), with a recording sampler. And both
baselines (naive, lockstep) train for real at tiny settings, as the command runs them."""

import asyncio

import pytest

from conftest import run_virtual
from buffer import RolloutTask
from rollout import RolloutConfig, run_trajectory
from rollout import PromptFormat
from proxy import Sampling
from task import Problem
from tools.bench_e2e import LockstepProxy


class TurnsEnv:
    """Ends after `turns` steps (reward 1 then); every reset and step takes latency_s; logs each step."""

    def __init__(self, name: str, latency_s: float, turns: int, log: list):
        self.name, self.latency_s, self.turns, self.log, self.n = name, latency_s, turns, log, 0

    async def reset(self, seed: int) -> str:
        await asyncio.sleep(self.latency_s)
        return "1+1="

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        await asyncio.sleep(self.latency_s)
        self.n += 1
        self.log.append(("step", self.name, self.n))
        done = self.n >= self.turns
        return " =2 answer:", float(done), done, {}


def test_lockstep_turn_waits_for_the_slowest_env_call_and_finished_trajectories_leave():
    from tiny_model import build_tokenizer
    tok = build_tokenizer()
    fmt = PromptFormat(tok, use_template=False)
    action = tok.encode("2", add_special_tokens=False)
    log = []

    def sample_fn(contexts, max_tokens):
        log.append(("batch", len(contexts)))
        return [(action, [-0.5] * len(action), "length") for _ in contexts]

    # (name, env latency, turns): the fast one is done after one turn, the slow one's calls take 100x
    specs = [("fast", 0.01, 1), ("mid", 0.1, 2), ("slow", 1.0, 3)]
    proxy = LockstepProxy(sample_fn, live=len(specs), version=7)
    cfg = RolloutConfig(max_tokens=8, max_model_len=120)

    async def one(name, latency_s, turns):
        t = RolloutTask(name, "g", Problem("1+1=", "2"), env="turns")
        try:
            return await run_trajectory(proxy, lambda: TurnsEnv(name, latency_s, turns, log), fmt, cfg, t)
        finally:
            proxy.leave()

    async def main():
        return await asyncio.gather(*(one(*s) for s in specs))

    samples = run_virtual(main())
    # every batch holds all live trajectories, and comes only after the slow env's call returned
    assert log == [("batch", 3), ("step", "fast", 1), ("step", "mid", 1), ("step", "slow", 1),
                   ("batch", 2), ("step", "mid", 2), ("step", "slow", 2),
                   ("batch", 1), ("step", "slow", 3)]
    assert [s.num_turns for s in samples] == [1, 2, 3] and all(s.reward == 1.0 for s in samples)
    slow = samples[2]
    assert slow.versions == [7] * (3 * len(action))            # the lockstep loop's policy version
    assert sum(slow.loss_mask) == 3 * len(action) < len(slow.response_ids)   # observations not trained


def test_lockstep_row_gets_its_own_budget():
    def sample_fn(contexts, max_tokens):
        assert max_tokens == 4                                  # the batch samples to its largest budget
        return [([1, 2, 3, 4], [-1.0] * 4, "length"), ([1, 9], [-1.0, -2.0], "stop")]

    proxy = LockstepProxy(sample_fn, live=2, version=0)

    async def main():
        return await asyncio.gather(proxy.generate([5], Sampling(2)), proxy.generate([6, 6], Sampling(4)))

    a, b = run_virtual(main())
    assert (a.token_ids, a.logprobs, a.finish_reason) == ([1, 2], [-1.0, -1.0], "length")   # cut to 2
    assert (b.token_ids, b.finish_reason, b.prompt_token_ids) == ([1, 9], "stop", [6, 6])


# ---------------------------------------------------------------------------------------------
# the baselines themselves, run for real at tiny settings (python -m tools.bench_e2e runs them first; the
# whole command: tests/test_tools_runs.py)


@pytest.fixture
def torch_threads():
    """The baselines run torch on every core (as the command does): this process's setting back after."""
    import torch
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def baseline_args(**kw):
    """bench_e2e's flags as its parser leaves them, tiny: batch 2 x 2, 2 steps."""
    import argparse
    args = dict(steps=2, naive_steps=2, target=0.5, batch_groups=2, group_size=2, max_tokens=0, micro_batch=8,
                lr=3e-4, loss="ppo", env="", env_latency_s=0.01, env_latency_sigma=0.5, env_hang_rate=0.0,
                timeout_s=120, verbose=False)
    return argparse.Namespace(**{**args, **kw})


def check_figures(r: dict, steps: int):
    import math
    assert r["steps"] == steps and r["steps_to_target"] is None and r["seconds_to_target"] is None
    for key in ("s_per_step", "wall_s", "reward_first10", "reward_last10"):
        assert isinstance(r[key], float) and math.isfinite(r[key]), key
    assert r["s_per_step"] > 0 and 0 <= r["reward_first10"] <= 1


def test_naive_baseline_trains_and_reports_its_figures(torch_threads):
    """The plain loop: transformers' generate, then Trainer.train_step (its reply budget resolved as
    train.py resolves it: RolloutConfig.resolved's signature once changed under it)."""
    from tools.bench_e2e import naive
    check_figures(naive(baseline_args(), seed=0), steps=2)


def test_lockstep_baseline_trains_on_the_calc_env(monkeypatch, tiny_model_dir, torch_threads):
    """The plain multi-turn loop over the calculator env (its sandbox, injected latency, deadlines), on the
    tiny model (the calc model's warm start takes many minutes here; the loop is what is tested)."""
    import ext.calc
    from tools.bench_e2e import lockstep
    monkeypatch.setattr(ext.calc, "ensure_calc_model", lambda log=print: tiny_model_dir)
    r = lockstep(baseline_args(env="calc"), seed=0)
    check_figures(r, steps=2)
    assert r["turns_mean"] >= 1 and r["samples_dropped_failed"] >= 0
