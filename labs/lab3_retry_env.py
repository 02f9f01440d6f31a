"""Lab 3: a multi-turn environment, "one retry": a wrong first answer gets a second try, at half reward.

An environment is two async methods (the Env protocol, `rollout` module docstring): `reset(seed)` returns
the first observation (the prompt), `step(action)` takes the model's text and returns (observation,
reward, done, info). `rollout.run_trajectory` (its loop is `rollout.rollout_once`) runs it for one sample:
reset, then generate -> step until done. The model's tokens go into the sample with loss mask 1, the
observations' tokens with mask 0 (the model did not choose them, so they are not trained), and the
sample's reward is the sum of the step rewards.

Why async: envs of many trajectories share one engine; while one env waits (a sandbox, a tool, a slow
verifier) the event loop lets the engine decode for the others. That is the paper's environment-level
asynchronous rollout, and the reason `step` awaits the verifier instead of calling it.

Implement RetryEnv:
- reset: the problem's prompt.
- step: score the answer with `rollout.score(self.problem, action, self.reward_fn)` (the task's verifier,
  or the run's --reward / verifier pool when reward_fn is given). Right (score 1.0): reward 1.0 on the
  first try, 0.5 on the second, done. Wrong on the first try: reward 0.0, not done, and an observation that
  tells the model to try again (short; the tiny model's tokenizer knows few characters: " no. again:\n"
  is safe). Wrong on the second try: reward 0.0, done.

docs/tour.md's section 3 follows one trajectory. Read for inspiration: `rollout.SingleTurnEnv` (one step)
and `ext/games.py`'s GuessEnv (many turns).
The grader runs your env through the real `rollout.run_trajectory` over `tools.fake_engine.FakeTimedEngine`
answering scripted text, and checks the turns, the tokens, the loss mask and the reward.

    .venv/bin/python -m pytest labs/lab3_retry_env_test.py
"""

from rollout import ENVS, score  # noqa: F401  (score: the verifier, for step)


class RetryEnv:
    def __init__(self, problem, reward_fn=None):
        self.problem, self.reward_fn = problem, reward_fn

    async def reset(self, seed: int) -> str:
        raise NotImplementedError("lab 3: RetryEnv.reset()")

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        raise NotImplementedError("lab 3: RetryEnv.step()")


# --env retry: the factory the env manager calls for every sample (a fresh env each time)
ENVS["retry"] = lambda problem, seed, reward_fn=None: RetryEnv(problem, reward_fn)
