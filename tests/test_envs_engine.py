"""Multi-turn envs end to end on a real vLLM CPU engine with the tiny model.

Every trajectory is replayed against a fresh env: its observation tokens must be exactly what the
env said (mask 0, logprob 0), its reward what the env gave, and the behaviour logprob of every
action token must equal a transformers forward pass over prompt + response within 1e-4."""

import asyncio
import itertools

import pytest
import torch

from buffer import Cmd, Command, LocalQueues, RolloutTask, SampleBuffer
from env_manager import EnvManager, RolloutConfig, env_seed
from envs import ENVS
from task import Problem
from trainer import token_logprobs

pytestmark = pytest.mark.engine
TOL = 1e-4


def segments(mask):
    """[(is_action, start, end)] runs of equal mask values."""
    out, i = [], 0
    for k, run in itertools.groupby(mask):
        n = len(list(run))
        out.append((k == 1, i, i + n))
        i += n
    return out


async def replay(env, seed, tok, s):
    """Re-run the env with the sample's actions; return (observations, reward) it produces."""
    first = await env.reset(seed)
    assert tok.decode(s.prompt_ids) == first
    obs, total = [], 0.0
    for is_action, a, b in segments(s.loss_mask):
        if is_action:
            o, r, done, _ = await env.step(tok.decode(s.response_ids[a:b], skip_special_tokens=True))
            total += r
            obs.append(o)
    return obs, total


def test_multi_turn_envs_end_to_end(vllm_proxy, hf):
    lt, proxy = vllm_proxy
    model, tok = hf
    cfg = RolloutConfig(max_tokens=6, max_turns=4, max_model_len=120)
    tasks = [RolloutTask(f"{env}{i}", f"{env}-group{i}", Problem("", ""), env=env)
             for env in ("chain", "guess") for i in range(3)]

    async def main():
        buf = SampleBuffer(LocalQueues(1), "engine test", timeout_s=120)
        mgr = EnvManager(proxy, buf, tok, rank=0, cfg=cfg)
        for t in tasks:
            await buf.put_tasks([t])
        run = asyncio.create_task(mgr.run())
        samples = [await buf.get_sample() for _ in tasks]
        await buf.send_command(0, Command(Cmd.STOP))
        return samples, await asyncio.wait_for(run, 60)
    samples, stats = lt.run(main(), timeout=300)

    assert stats["samples_sent"] == len(tasks) and stats["samples_failed"] == 0 and stats["in_flight"] == 0
    assert any(s.num_turns > 1 for s in samples)
    # the model's EOS ends a turn and is trained on: it sits in response_ids with mask 1
    assert any(t == tok.eos_token_id and m == 1 for s in samples for t, m in zip(s.response_ids, s.loss_mask))
    for s in samples:
        assert not s.failed and s.num_tokens <= cfg.max_model_len
        assert len(s.response_ids) == len(s.logprobs) == len(s.loss_mask)
        assert len(s.versions) == sum(s.loss_mask) and set(s.versions) == {proxy.version}
        assert s.loss_mask[0] == 1 and s.loss_mask[-1] == 1          # starts and ends with an action
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if m == 0)
        # observation tokens are exactly the env's text, and the reward is the env's
        env = ENVS[s.task_id.rstrip("0123456789")](None, 0)
        obs, reward = lt.run(replay(env, env_seed(s.group_id), tok, s))
        got_obs = [tok.decode(s.response_ids[a:b])
                   for is_action, a, b in segments(s.loss_mask) if not is_action]
        assert got_obs == obs[:len(got_obs)] and len(got_obs) == s.num_turns - 1
        assert s.reward == pytest.approx(min(1.0, reward))
        # behaviour logprobs on action tokens == transformers on the same float32 weights
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            ref = token_logprobs(model, ids, torch.ones_like(ids))[0, len(s.prompt_ids):].tolist()
        diffs = [abs(a - b) for a, b, m in zip(s.logprobs, ref, s.loss_mask) if m == 1]
        assert max(diffs) < TOL, (s.task_id, max(diffs))
