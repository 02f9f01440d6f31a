"""ext/deadlines.py: adaptive timeouts, T = min(max(floor, factor * anchor), ceiling), for env calls and
verifiers (on by default: --env-timeout-factor 3).

    t = AdaptiveTimeout(ceiling_s=30, factor=3, floor_s=5)     # the ceiling until an anchor is known
    t.anchor_s = 0.8; t.current_s                               # -> 5.0 (3 x 0.8 = 2.4, under the floor)
    env = EnvDeadline.of(rollout_cfg, part)  # a rank's env calls: anchor = a quantile of recent latencies
    reward = RewardDeadline(10, factor=2, floor_s=1)   # ext/verifiers.py: anchor = slowest correct answer

Both owners keep their own statistic and share the clamp (AdaptiveTimeout), so the rule lives once:
- EnvDeadline (every env call of a rollout rank, in place of rollout.FixedDeadline: Extension.env_deadline):
  the anchor is the --env-timeout-quantile of the last WINDOW calls of a kind (reset or step), after
  MIN_SAMPLES of them; factor --env-timeout-factor; ceiling --env-step-timeout-s.
- RewardDeadline (ext/verifiers.py's pool, RollPacker's reward scheduler): the anchor is the slowest
  correct answer (reward 1) seen so far, T = min(max(T_min, lambda * T_anchor), T_max) with lambda
  --reward-timeout-factor, T_min --reward-timeout-min-s, T_max --reward-timeout-s. A correct answer tends
  to end early; a call that outlives every correct one by lambda is cut and scores 0.
factor 0 turns either off: every call gets the ceiling (the fixed timeout).
"""

import bisect
import collections
import math
from dataclasses import dataclass

from config import Extension, extension, opt

# Completed calls of a kind an EnvDeadline needs before it adapts; until then every call of that
# kind gets the ceiling. The 0.99-quantile of fewer than 100 calls is just their max, and the first
# calls to complete are the fastest of those that started together (the slow ones still run): with
# 20, the sim's envasync (latency normal(10, 10) s) cut steps at 29 s that 1 call in 44 outlasts.
MIN_SAMPLES = 100
WINDOW = 256            # the latest calls of a kind it remembers: the deadline follows a drift


class AdaptiveTimeout:
    """min(max(floor_s, factor * anchor_s), ceiling_s) seconds; ceiling_s while anchor_s is None, or
    always when factor is 0 (a fixed timeout). The owner sets anchor_s from what it observes."""

    def __init__(self, ceiling_s: float, factor: float = 0.0, floor_s: float = 0.0):
        self.ceiling_s, self.factor, self.floor_s = ceiling_s, factor, floor_s
        self.anchor_s: float | None = None

    @property
    def current_s(self) -> float:
        if self.factor <= 0 or self.anchor_s is None:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.anchor_s * self.factor))


class RewardDeadline(AdaptiveTimeout):
    """A verifier call's timeout: the anchor is the slowest correct answer so far (T_anchor)."""

    CORRECT = 1.0        # a reward this high is a correct answer (the verifiers here score 0 or 1)

    def record(self, latency_s: float, reward: float):
        """A call answered `reward` after latency_s seconds (a call cut by the timeout is not recorded:
        it scored 0, so it was not a correct answer)."""
        if reward >= self.CORRECT and (self.anchor_s is None or latency_s > self.anchor_s):
            self.anchor_s = latency_s


class EnvDeadline:
    """How long the next env call may take, seconds: clamp(quantile(latencies) * factor, floor_s,
    ceiling_s) over the last WINDOW calls of its kind (reset or step: an env's reset is often
    instant and its step a tool or the verifier, so each kind has its own); ceiling_s before
    MIN_SAMPLES of them, or always when factor is 0 (the fixed timeout). One per EnvManager, shared
    by its trajectories: a slow tail is cut at a few times what such calls take now, not at a fixed
    worst case, so a stuck call fails (and is retried) soon.
    A timed-out call is recorded as taking its limit (censored: it took at least that). As long as
    fewer than 1 - quantile of the calls time out, that never moves the quantile: hung calls do not
    ratchet the deadline up. When more do, the deadline evidently cuts a kind of call that is slow,
    not stuck (a slow verifier among instant steps, an env that got slower): it grows by `factor`
    a round, up to the ceiling. Without this it could cut such calls forever (none of them would
    ever complete and be recorded), and so the deadline never cuts more than ~1 - quantile of calls."""

    KINDS = ("reset", "step")

    def __init__(self, ceiling_s: float, quantile: float = 1.0, factor: float = 0.0, floor_s: float = 0.0,
                 reward_s: float = 0.0):
        self.ceiling_s, self.quantile, self.factor = ceiling_s, quantile, factor
        # a step awaits the verifier, which has a timeout of its own (reward_s: it then scores 0 and
        # replaces its worker): never cut a step before that answer can arrive (1.5x: some room for it)
        floors = {"reset": floor_s, "step": max(floor_s, 1.5 * reward_s)}
        self.timeouts = {k: AdaptiveTimeout(ceiling_s, factor, floors[k]) for k in self.KINDS}
        self.latencies = {k: collections.deque(maxlen=WINDOW) for k in self.KINDS}   # seconds, in order
        self.ranked = {k: [] for k in self.KINDS}     # the same latencies, sorted (for the quantile)

    @classmethod
    def of(cls, rollout, part: "DeadlineConfig", reward_s: float = 0.0) -> "EnvDeadline":
        """From a RolloutConfig's --env-step-timeout-s (the ceiling), this file's flags, and the verifier's
        timeout (reward_s, for the steps' floor)."""
        return cls(rollout.env_step_timeout_s, part.env_timeout_quantile, part.env_timeout_factor,
                   part.env_timeout_floor_s, reward_s)

    @property
    def current_s(self) -> dict[str, float]:
        """{"reset": s, "step": s}: the deadline of the next call of each kind."""
        return {k: t.current_s for k, t in self.timeouts.items()}

    @property
    def floor_s(self) -> dict[str, float]:
        return {k: t.floor_s for k, t in self.timeouts.items()}

    def record(self, kind: str, latency_s: float):
        """A call of `kind` ended after latency_s seconds: it completed, or timed out at that limit."""
        xs, ranked = self.latencies[kind], self.ranked[kind]
        if len(xs) == WINDOW:                 # the oldest leaves the window (kept sorted: no sort per call)
            del ranked[bisect.bisect_left(ranked, xs[0])]
        xs.append(latency_s)
        bisect.insort(ranked, latency_s)
        if len(xs) >= MIN_SAMPLES:
            # nearest-rank quantile
            self.timeouts[kind].anchor_s = ranked[max(0, math.ceil(self.quantile * len(xs)) - 1)]


@dataclass
class DeadlineConfig:
    # the adaptive env deadline (EnvDeadline): clamp(quantile(recent latencies) * factor, floor, ceiling)
    env_timeout_quantile: float = opt(0.99, "adaptive env deadline: this quantile of the recent env calls' "
                                            "latencies, times --env-timeout-factor")
    env_timeout_factor: float = opt(3.0, "adaptive env deadline: the recent latency quantile times this, "
                                         "within [--env-timeout-floor-s, --env-step-timeout-s]; 0 = off: "
                                         "every env call gets --env-step-timeout-s")
    # 5 s: with 1 s, a 40-step --env calc run on 2 busy cores timed out 104 env calls (then retried)
    env_timeout_floor_s: float = opt(5.0, "adaptive env deadline: never under this, seconds")

    def __post_init__(self):
        if not 0 < self.env_timeout_quantile <= 1:
            raise ValueError(f"--env-timeout-quantile must be in (0, 1], got {self.env_timeout_quantile}")
        if self.env_timeout_factor < 0:
            raise ValueError(f"--env-timeout-factor must be >= 0 (0 = a fixed --env-step-timeout-s), got "
                             f"{self.env_timeout_factor}")
        if self.env_timeout_floor_s <= 0:
            raise ValueError(f"--env-timeout-floor-s must be > 0, got {self.env_timeout_floor_s}")


@extension
class Deadlines(Extension):
    name, Config = "deadlines", DeadlineConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return part.env_timeout_factor > 0

    def env_deadline(self):
        reward_s = getattr(self.cfg.ext.get("verifiers"), "reward_timeout_s", 0.0)
        return EnvDeadline.of(self.cfg.rollout, self.part, reward_s)
