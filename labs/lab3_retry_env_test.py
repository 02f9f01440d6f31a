"""Lab 3's grader: the student's RetryEnv, built from rollout.ENVS["retry"] as the env manager builds it,
run through the real rollout.run_trajectory over a fake engine whose answers are scripted."""

import asyncio

import pytest

import rollout
from buffer import RolloutTask
from labs.grading import load
from proxy import LLMProxy
from rollout import PromptFormat, RolloutConfig, run_trajectory
from task import Problem
from tiny_model import build_tokenizer
from tools.fake_engine import FakeTimedEngine

impl = load("lab3_retry_env")
TOK = build_tokenizer()              # the embedded model's: one token a character, EOS = 1
FMT = PromptFormat(TOK)              # env text -> tokens, as a run's rollout ranks do it
CFG = RolloutConfig(max_tokens=8, max_model_len=120, max_turns=8, max_retries=0)
PROBLEM = Problem("2+2=", "4")


class Recorder:
    """Wraps the env: keeps what each step returned (the grader needs the observation's text)."""

    def __init__(self, env):
        self.env, self.steps = env, []

    async def reset(self, seed):
        return await self.env.reset(seed)

    async def step(self, action):
        out = await self.env.step(action)
        self.steps.append((action, *out))
        return out


def roll(replies: list[str], reward_fn=None, problem=PROBLEM):
    """One trajectory whose model turns answer replies[0], replies[1], ... (each then EOS). Returns the
    Sample and the env's steps: (action, observation, reward, done, info)."""
    assert "retry" in rollout.ENVS, 'register the env: rollout.ENVS["retry"] = its factory'
    answers, envs, errors = iter(replies), [], []
    engine = FakeTimedEngine(t0=0.0, k=0.0, respond=lambda context_ids: action(next(answers)))

    def new_env():
        envs.append(Recorder(rollout.ENVS["retry"](problem, 0, reward_fn)))
        return envs[-1]

    async def on_failure(s):
        errors.append(s.meta["error"])

    async def main():
        proxy = LLMProxy(engine)
        try:
            task = RolloutTask("t0.0", "g0", problem, env="retry")
            return await run_trajectory(proxy, new_env, FMT, CFG, task, on_failure=on_failure)
        finally:
            proxy.shutdown()
    sample = asyncio.run(main())
    assert sample is not None, f"the trajectory failed: {errors}"
    return sample, envs[-1].steps


def action(text: str) -> list[int]:
    """A model turn's tokens: its text, then the EOS it ended on (trained: it is how the model stops)."""
    return TOK.encode(text) + [TOK.eos_token_id]


def test_right_the_first_time():
    s, steps = roll(["4", "4"])
    assert s.prompt_ids == FMT.first(PROBLEM.prompt), (
        f"reset must return the problem's prompt {PROBLEM.prompt!r}; the sample's prompt is "
        f"{TOK.decode(s.prompt_ids)!r}")
    assert s.num_turns == 1 and len(steps) == 1, (
        f"a right first answer ends the episode (done): it ran {len(steps)} steps")
    assert s.reward == 1.0, f"right the first time: reward {s.reward}, want 1.0"
    assert s.response_ids == action("4") and s.loss_mask == [1, 1] and len(s.versions) == 2, (
        f"one model turn, '4' and its EOS, both trained: response {s.response_ids}, mask {s.loss_mask}")


def test_right_the_second_time_gets_half():
    s, steps = roll(["5", "4"])
    assert len(steps) == 2 and s.num_turns == 2, (
        f"a wrong first answer must not end the episode: {len(steps)} step(s), {s.num_turns} turn(s)")
    (_, obs, r1, done1, _), (_, _, r2, done2, _) = steps
    assert (r1, done1) == (0.0, False), (
        f"the first, wrong, step: (reward, done) {(r1, done1)}, want (0.0, False)")
    assert obs.strip(), "the first step's observation should tell the model to try again"
    assert (r2, done2) == (0.5, True), (
        f"right on the second try: (reward, done) {(r2, done2)}, want (0.5, True): the reward halved")
    assert s.reward == 0.5, f"the sample's reward is the sum of its step rewards: {s.reward}, want 0.5"
    obs_ids = FMT.next(obs, TOK.eos_token_id)        # the observation's tokens after a turn ended on EOS
    assert s.response_ids == action("5") + obs_ids + action("4"), (
        f"the response is turn 1, the observation, turn 2: got {TOK.decode(s.response_ids)!r}")
    assert s.loss_mask == [1, 1] + [0] * len(obs_ids) + [1, 1], "1 on the model's tokens, 0 on the env's"
    assert len(s.versions) == sum(s.loss_mask) == 4, "a policy version per model token"
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m), "observation tokens: logprob 0"


def test_wrong_twice_ends_with_nothing():
    s, steps = roll(["5", "3", "4"])
    assert len(steps) == 2 and s.num_turns == 2, "two tries at most: the second one is done, right or wrong"
    got = [st[2:4] for st in steps]
    assert got == [(0.0, False), (0.0, True)], (
        f"wrong, then wrong again: the steps' (reward, done) were {got}; want reward 0.0 and not done after "
        f"the first, reward 0.0 and done after the second")
    assert s.reward == 0.0, f"wrong twice: reward {s.reward}, want 0.0"
    assert sum(s.loss_mask) == len(s.versions) == 4, "two model turns of two tokens each are trained"


@pytest.mark.parametrize("replies, want", [(["7"], 1.0), (["4", "7"], 0.5), (["4", "4"], 0.0)])
def test_the_runs_verifier_decides(replies, want):
    """With a reward_fn (--reward, the verifier pool) the env asks it, through rollout.score, not the task's
    verifier: this judge wants "7"."""
    async def judge(problem, response):
        return float(response.strip() == "7")
    s, _ = roll(replies, reward_fn=judge)
    assert s.reward == want, (
        f"the answers {replies} under a run's verifier that wants '7' (the reward_fn the env was given): "
        f"reward {s.reward}, want {want}; score with rollout.score(self.problem, action, self.reward_fn)")
