"""ext/faults.py: injected env latency, failures and hangs (--env-latency-s, --env-latency-sigma,
--env-fail-rate, --env-hang-rate), for the failure paths and the env-level-async experiments. Every env of a
rollout rank is wrapped (Extension.env_wrapper), each rank with its own seeded draws.

Simplifications: LatencyEnv clips negative draws to 0 (mean=10, std=10 gives about 10.8 s); FaultyEnv also
fails resets.
"""

import asyncio
import math
import random
from dataclasses import dataclass

from config import Extension, extension, opt


class LatencyEnv:
    """Adds a delay before every reset and step (seconds): normal(mean_s, std_s) clipped at 0, or with
    sigma > 0 a heavy-tailed lognormal of median mean_s (as sandboxes, simulators and web pages are)."""

    def __init__(self, env, mean_s: float, std_s: float, rng: random.Random, sigma: float = 0.0):
        if mean_s < 0 or std_s < 0 or sigma < 0:
            raise ValueError(f"LatencyEnv: mean_s, std_s and sigma must be >= 0, got {mean_s}, {std_s}, "
                             f"{sigma}")
        self.env, self.mean_s, self.std_s, self.rng, self.sigma = env, mean_s, std_s, rng, sigma

    async def _delay(self):
        if self.sigma:
            await asyncio.sleep(self.mean_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0)))
        else:
            await asyncio.sleep(max(0.0, self.rng.gauss(self.mean_s, self.std_s)))

    async def reset(self, seed: int) -> str:
        await self._delay()
        return await self.env.reset(seed)

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        await self._delay()
        return await self.env.step(action)


class EnvFault(RuntimeError):
    """An injected environment failure (FaultyEnv)."""


class FaultyEnv:
    """Per call (reset or step): raises EnvFault with probability fail_rate, hangs forever with
    probability hang_rate, else passes through."""

    def __init__(self, env, fail_rate: float, hang_rate: float, rng: random.Random):
        if fail_rate < 0 or hang_rate < 0 or fail_rate + hang_rate > 1:
            raise ValueError(f"FaultyEnv: need rates >= 0 with fail_rate + hang_rate <= 1, "
                             f"got fail_rate={fail_rate}, hang_rate={hang_rate}")
        self.env, self.fail_rate, self.hang_rate, self.rng = env, fail_rate, hang_rate, rng

    async def _maybe_fail(self, phase: str):
        u = self.rng.random()
        if u < self.fail_rate:
            raise EnvFault(f"injected env failure during {phase}")
        if u < self.fail_rate + self.hang_rate:
            await asyncio.Event().wait()   # never set: only the caller's timeout ends this

    async def reset(self, seed: int) -> str:
        await self._maybe_fail("reset")
        return await self.env.reset(seed)

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        await self._maybe_fail("step")
        return await self.env.step(action)


@dataclass
class FaultConfig:
    """Testing the failure paths: every env wrapped with injected latency, failures and hangs."""
    env_fail_rate: float = opt(0.0, "testing: inject env failures, the chance an env call raises")
    env_hang_rate: float = opt(0.0, "testing: inject env hangs, the chance an env call never returns")
    env_latency_s: float = opt(0.0, "testing: inject env latency, normal(mean=this, std=this) per call, "
                                    "seconds")
    env_latency_sigma: float = opt(0.0, "> 0: the injected latency is lognormal instead, median "
                                        "--env-latency-s and this sigma (heavy-tailed)")

    @property
    def any(self) -> bool:
        return bool(self.env_latency_s or self.env_fail_rate or self.env_hang_rate)

    def __post_init__(self):
        if not (0 <= self.env_fail_rate and 0 <= self.env_hang_rate
                and self.env_fail_rate + self.env_hang_rate <= 1):
            raise ValueError(f"--env-fail-rate {self.env_fail_rate} and --env-hang-rate "
                             f"{self.env_hang_rate}: need rates >= 0 that sum to <= 1")
        if self.env_latency_s < 0 or self.env_latency_sigma < 0:
            raise ValueError(f"--env-latency-s and --env-latency-sigma must be >= 0, got "
                             f"{self.env_latency_s}, {self.env_latency_sigma}")

    def wrapper(self, seed: int):
        """(env) -> env wrapping every env of a rollout rank (EnvManager's env_wrappers); None: nothing
        injected."""
        if not self.any:
            return None
        rng = random.Random(seed)

        def wrap(env):
            if self.env_latency_s:
                env = LatencyEnv(env, self.env_latency_s, self.env_latency_s, rng, self.env_latency_sigma)
            if self.env_fail_rate or self.env_hang_rate:
                env = FaultyEnv(env, self.env_fail_rate, self.env_hang_rate, rng)
            return env
        return wrap


@extension
class Faults(Extension):
    name, Config = "faults", FaultConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return part.any

    def env_wrapper(self, index: int):
        return self.part.wrapper(self.cfg.train.seed * 1000 + index)
