"""ext/tail_batching.py: RollPacker's tail batching (arXiv 2509.21009, --tail-batching), an Admission policy:
short rounds, long rounds and the long-prompt queue.

    policy = TailBatching(ctrl_cfg, oversample=1.5, extra_samples=0)
    ctrl = AsyncController(ctrl_cfg, buffer, problems, n, admission=policy)

- Short round: (alpha + 1) * B + ceil((oversample - 1) * B) + redundant groups in flight (at alpha 0:
  1.5 B + redundant for the one batch), each single-turn prompt with extra_samples samples beyond the
  group size (the first group-size to finish make the group). A group admitted at version a that is
  not complete at the end of step a + alpha (at alpha 0: the step it was admitted in) is overdue: its
  work is aborted and its prompt goes to the long-prompt queue, whole (its partial answers are thrown
  away), never lost.
- Long round: once the long queue holds B prompts, its first B, admitted at once, no over-sampling, no
  redundant prompts, each run until it is complete; a group lost to filtering or failure is replaced from
  the long queue, then the stream. At alpha 0 the step is exactly those groups. At alpha > 0 a long group
  gets alpha + 1 versions like any other (the freshness rule): one still running then is dropped,
  counted in prompts_long_dropped.
State for checkpoints: the long queue, plus long groups in flight (they go back to its front). A round's
batch holds its places in flight until its step ends, streamed or not.
"""

import collections
import enum
import math
from dataclasses import dataclass

from config import Extension, extension, opt
from controller import Admission, ControllerConfig
from task import Problem


class Round(enum.StrEnum):
    SHORT = "short"     # over-sampled; what is not done in time is deferred to the long queue
    LONG = "long"       # the long queue's prompts, run to full length


class TailBatching(Admission):
    def __init__(self, cfg: ControllerConfig, oversample: float = 1.5, extra_samples: int = 0):
        super().__init__(cfg)
        self.B, self.alpha = cfg.batch_groups, cfg.async_ratio
        self.oversample, self.extra_samples = oversample, extra_samples
        self.round = Round.SHORT
        self.long_queue: collections.deque[Problem] = collections.deque()
        self.admitted_at: dict[str, int] = {}    # unresolved group -> the version it was admitted at
        self.long: set[str] = set()              # unresolved groups admitted in a long round
        self.deferred = 0                        # prompts moved to the long queue, over the run
        self.long_dropped = 0                    # long groups still running after alpha + 1 versions
        self.long_taken = 0                      # long-round groups in this step's batch
        self.before = (0, 0)                     # (deferred, long_dropped) when this step began

    def begin_step(self, ctrl) -> int:
        self.round = Round.LONG if len(self.long_queue) >= self.B else Round.SHORT
        self.long_taken, self.before = 0, (self.deferred, self.long_dropped)
        return min(self.B, len(self.long_queue)) if self.round == Round.LONG else 0   # a long round's block

    def target(self) -> int:
        """Groups in flight (admitted, neither taken before this step nor lost) allowed in this round."""
        if self.round == Round.LONG:
            return (self.alpha + 1) * self.B
        return (self.alpha + 1) * self.B + math.ceil((self.oversample - 1) * self.B) + self.cfg.redundant

    def capacity(self, ctrl) -> int:
        return self.target() - ctrl.groups_holding_places()

    def next_problem(self) -> Problem | None:
        if self.round == Round.LONG and self.long_queue:
            return self.long_queue.popleft()
        return None

    def admitted(self, gid: str, version: int) -> int:
        self.admitted_at[gid] = version
        if self.round == Round.LONG:
            self.long.add(gid)
        extra = self.extra_samples if not self.cfg.env and self.round == Round.SHORT else 0
        return max(super().admitted(gid, version), self.cfg.group_size + extra)

    def taken(self, gid: str):
        self.long_taken += gid in self.long

    def resolved(self, gid: str):
        self.admitted_at.pop(gid, None)
        self.long.discard(gid)

    def overdue(self, version: int, unresolved) -> list[str]:
        """At the end of step `version`: the groups among `unresolved` (in flight, not complete) that were
        admitted alpha or more versions ago, i.e. that cannot all be fresh at the next version."""
        return [g for g in unresolved if self.admitted_at.get(g, version) <= version - self.alpha]

    def give_up(self, gid: str, problem: Problem | None) -> bool:
        """An overdue group: a short one's prompt goes to the long queue (True); a long one is dropped
        (False), counted."""
        long = gid in self.long
        self.resolved(gid)
        if long:
            self.long_dropped += 1
            return False
        if problem is not None:
            self.long_queue.append(problem)
            self.deferred += 1
        return True

    async def end_step(self, ctrl) -> dict:
        """Abort the groups that had their alpha + 1 versions and are not complete; a short round's prompts
        go to the long queue, a long round's are dropped."""
        ready = {g[0].group_id for g in ctrl.assembler.ready}
        overdue = self.overdue(ctrl.version, [g for g in ctrl.problem_of if g not in ready])
        for gid in overdue:                   # given up on (deferred); then their work is aborted
            ctrl.assembler.defer(gid, ctrl.version)
            self.give_up(gid, ctrl.problem_of.pop(gid, None))
        if overdue:
            await ctrl.abort_groups(overdue)
        return {"round": str(self.round), "prompts_deferred": self.deferred - self.before[0],
                "long_queue": len(self.long_queue), "groups_long_trained": self.long_taken,
                "prompts_long_dropped": self.long_dropped - self.before[1]}

    def counters(self, ctrl) -> dict:
        return {"prompts_deferred": self.deferred, "prompts_long_dropped": self.long_dropped,
                "groups_deferred": ctrl.assembler.groups_deferred,
                "samples_deferred": ctrl.assembler.samples_deferred,
                "long_queue": len(self.long_queue)}

    def state(self, ctrl) -> dict:
        """The prompts in flight, apart from a long round's: those go back to the long queue's front."""
        return {"in_flight": ctrl.in_flight_problems(skip=self.long),
                "long_queue": [ctrl.problem_of[g] for g in self.long if g in ctrl.problem_of]
                + list(self.long_queue)}

    def restore(self, ctrl, state: dict):
        ctrl.readmit.extend(state.get("in_flight", []))
        self.long_queue.extend(state.get("long_queue", []))


@dataclass
class TailConfig:
    tail_batching: bool = opt(False, "RollPacker's tail batching: short rounds over-sample prompts "
                                     "(--tail-oversample) and defer every group not done within "
                                     "async-ratio + 1 steps of its admission to a long-prompt queue; once "
                                     "it holds a batch, a long round runs those prompts to full length "
                                     "(ext/tail_batching.py)")
    tail_oversample: float = opt(1.5, "tail batching: a short round admits this many times --batch-groups "
                                      "prompts for its batch (plus --redundant)")
    tail_extra_samples: int = opt(0, "tail batching, single-turn: a short round runs this many samples per "
                                     "prompt beyond --group-size, and the first group-size to finish make "
                                     "the group (biases groups towards their shorter answers); 0 = none")

    def __post_init__(self):
        if self.tail_oversample < 1 or self.tail_extra_samples < 0:
            raise ValueError(f"--tail-oversample must be >= 1 and --tail-extra-samples >= 0, got "
                             f"{self.tail_oversample} and {self.tail_extra_samples}")


@extension
class TailBatchingExt(Extension):
    name, Config = "tail_batching", TailConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return part.tail_batching

    @classmethod
    def configure(cls, cfg, part):
        if part.tail_batching and cfg.controller.rollout_mode != "queue":
            raise ValueError("--tail-batching ends a short round as soon as its batch is complete: it needs "
                             "--rollout-mode queue")

    def admission(self, ctrl_cfg):
        return TailBatching(ctrl_cfg, self.part.tail_oversample, self.part.tail_extra_samples)

    def step_line(self, row: dict):
        return f"{row['round']} round, {row['prompts_deferred']} deferred, long queue {row['long_queue']}"

    def on_row(self, row: dict):
        t = self.totals = getattr(self, "totals", collections.Counter())
        t.update({k: row.get(k) or 0 for k in ("prompts_deferred", "tokens_aborted", "tokens_generated",
                                               "time_trainer_busy", "time_step")})
        t["long_rounds"] += row.get("round") == "long"

    def summary_lines(self, runlog):
        t = getattr(self, "totals", collections.Counter())
        return [f"  tail       {t['prompts_deferred']} prompts deferred, {t['long_rounds']} long rounds, "
                f"{t['tokens_aborted'] / max(t['tokens_generated'], 1):.1%} of generated tokens aborted; "
                f"trainer busy {t['time_trainer_busy'] / max(t['time_step'], 1e-9):.0%} of the step time"]

