"""Lab 3's reference: RetryEnv over the project's rollout.score (the task's verifier, or the run's)."""

from rollout import ENVS, score


class RetryEnv:
    def __init__(self, problem, reward_fn=None):
        self.problem, self.reward_fn, self.tries = problem, reward_fn, 0

    async def reset(self, seed: int) -> str:
        return self.problem.prompt

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.tries += 1
        r = await score(self.problem, action, self.reward_fn)      # the task's verifier
        if r == 1.0 or self.tries == 2:
            return "", r / self.tries, True, {}
        return " no. again:\n", 0.0, False, {}


ENVS["retry"] = lambda problem, seed, reward_fn=None: RetryEnv(problem, reward_fn)
