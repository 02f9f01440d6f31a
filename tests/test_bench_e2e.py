"""tools/bench_e2e.py's baselines. The lockstep loop, the baseline the agentic benchmark compares the system
with, must really be lockstep (a turn starts only once every env call of the turn before returned), or its
ratios mean nothing: in fast-forwarded virtual time (looptime), with a recording sampler. Both baselines
(naive, lockstep) train for real at tiny settings where the command runs them: tests/test_tools_runs.py
(test_bench_e2e_naive_sync_and_async, test_bench_e2e_agentic_lockstep_and_system)."""

import asyncio

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
