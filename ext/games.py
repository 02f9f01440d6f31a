"""ext/games.py: two multi-turn text games (--env guess, --env chain), agentic RL at the tiny model's size.

    guess   find a secret number in 0..99 from "higher" / "lower" hints; reward 1, 0.9, 0.81, ... by guesses
    chain   a running sum, one addition per turn; reward = the share answered correctly

All text uses only tiny_model.CHARS, and every game is deterministic given the seed. Simplification: the
games ignore the Problem and build their state from the seed.
"""

import random
import re

from rollout import ENVS


def _first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group()) if m else None


class GuessEnv:
    """Guess the secret number in 0..99; the observation says "higher", "lower" or "correct"."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay        # reward per extra guess: 1, 0.9, 0.81, ...
        self.secret = 0
        self.guesses = 0

    async def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randrange(100)
        self.guesses = 0
        return "guess my number, 0 to 99:\n"

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.guesses += 1
        g = _first_int(action)
        if g is None:
            return " say a number:\n", 0.0, False, {"valid": False}
        if g == self.secret:
            return " correct!\n", self.decay ** (self.guesses - 1), True, {"valid": True}
        return (" higher:\n" if g < self.secret else " lower:\n"), 0.0, False, {"valid": True}


class ChainEnv:
    """A running sum over `steps` additions, one per turn; reward = fraction answered correctly."""

    def __init__(self, steps: int = 3, max_operand: int = 20):
        if steps < 1:
            raise ValueError(f"ChainEnv.steps must be >= 1, got {steps}")
        self.steps = steps
        self.max_operand = max_operand   # operands drawn from 0..max_operand-1
        self.terms: list[int] = []
        self.i = 0                       # next step to answer, 0-based

    async def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.terms = [rng.randrange(self.max_operand) for _ in range(self.steps + 1)]
        self.i = 0
        return f"{self.terms[0]}+{self.terms[1]}="

    def _partial(self, step: int) -> int:
        return sum(self.terms[: step + 2])

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        want = self._partial(self.i)
        ok = _first_int(action) == want
        r = (1.0 if ok else 0.0) / self.steps
        self.i += 1
        if self.i == self.steps:
            return "", r, True, {"correct": ok}
        hint = " ok\n" if ok else f" no, {want}\n"   # tell the true partial sum so the chain goes on
        return f"{hint}+{self.terms[self.i + 1]}=", r, False, {"correct": ok}


ENVS["guess"] = lambda problem, seed, reward_fn=None: GuessEnv()
ENVS["chain"] = lambda problem, seed, reward_fn=None: ChainEnv()
