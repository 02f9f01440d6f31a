"""ext/longtail.py: a long-tail length workload for real engines (--response-len-median, benchmarks): each
training prompt asks for exactly lognormal(median, --response-len-sigma) response tokens (Problem.target_len,
EOS ignored), drawn once per prompt, so a deferred prompt (tail batching) keeps its length. The answer is
scored up to its first EOS; the tokens after it are generated and trained through, out of the loss
(rollout.rollout_once, for any turn generated past its EOS).

How: the single-turn env (rollout.ENVS[""]) becomes ExactLength for a problem with a target_len, an env
that shapes its turn's sampling (Env.sampling); every other problem gets the core's SingleTurnEnv. The
benchmarks (tools/bench*.py) make such problems themselves.
"""

import functools
import math
import random
from dataclasses import dataclass, replace

import rollout
from config import Extension, extension, opt


class ExactLength(rollout.SingleTurnEnv):
    """The single-turn env, answering in exactly the problem's target_len tokens (EOS ignored)."""

    def sampling(self, s: rollout.Sampling) -> rollout.Sampling:
        return replace(s, max_tokens=self.problem.target_len, ignore_eos=True)   # (capped at the room)


def single_turn(problem, seed: int, reward_fn=None):
    """rollout.ENVS[""]: ExactLength for a problem with a target_len, else the core's SingleTurnEnv."""
    env = ExactLength if problem.target_len > 0 else rollout.SingleTurnEnv
    return env(problem, reward_fn)


rollout.ENVS[""] = single_turn


@dataclass
class LongTailConfig:
    response_len_median: float = opt(0.0, "a long-tail length workload (benchmarks): each training prompt "
                                          "asks for exactly lognormal(this, --response-len-sigma) response "
                                          "tokens, drawn once per prompt (EOS ignored: the answer is scored "
                                          "up to its first EOS, the tokens after it are generated and "
                                          "trained through but out of the loss); 0 = off")
    response_len_sigma: float = opt(1.0, "--response-len-median's lognormal sigma")

    def __post_init__(self):
        if self.response_len_median < 0 or self.response_len_sigma < 0:
            raise ValueError(f"--response-len-median and --response-len-sigma must be >= 0, got "
                             f"{self.response_len_median}, {self.response_len_sigma}")

    def response_len(self, rng: random.Random) -> int:
        return max(1, round(rng.lognormvariate(math.log(self.response_len_median), self.response_len_sigma)))

    def with_lengths(self, problems, make, seed: int):
        """(problems, make) with a drawn length each: the dataset's rows once, generated ones as made."""
        rng = random.Random(seed + 7)
        problems = problems and [replace(p, target_len=self.response_len(rng)) for p in problems]
        return problems, functools.partial(self._with_length, make)

    def _with_length(self, make, rng: random.Random):
        return replace(make(rng), target_len=self.response_len(rng))


@extension
class LongTail(Extension):
    name, Config = "longtail", LongTailConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return part.response_len_median > 0

    def problem_source(self, source, seed: int):
        return self.part.with_lengths(*source, seed)
