"""tail.py: RollPacker's tail batching (arXiv 2509.21009) for the AsyncController: short rounds, long
rounds and the long-prompt queue. The controller asks it which round a step is, how many groups may be
in flight, where the next prompt comes from, and which groups to give up on at the end of a step.

    tb = TailBatcher(batch_groups=B, async_ratio=alpha, oversample=1.5, extra_samples=0)
    kind = tb.begin_step()         # Round.LONG once the long queue holds B prompts, else Round.SHORT
    n = tb.target(redundant)       # groups in flight allowed in this round
    gids = tb.overdue(version, unresolved)   # at the end of step `version`: what the round gives up on

- Short round: (alpha + 1) * B + ceil((oversample - 1) * B) + redundant groups in flight (at alpha 0:
  1.5 B + redundant for the one batch), each single-turn prompt with extra_samples samples beyond the
  group size (the first group-size to finish make the group). A group admitted at version a that is
  not complete at the end of step a + alpha (at alpha 0: the step it was admitted in) is overdue: its
  work is aborted and its prompt goes to the long-prompt queue, whole (its partial answers are thrown
  away), never lost.
- Long round: the first B prompts of the long queue, admitted at once, no over-sampling, no redundant
  prompts, each run until it is complete; a group lost to filtering or failure is replaced from the
  long queue, then the stream. At alpha 0 the step is exactly those groups. At alpha > 0 a long group
  gets alpha + 1 versions like any other (the freshness rule): one still running then is dropped,
  counted in prompts_long_dropped.
State for checkpoints: the long queue, plus long groups in flight (they go back to its front).
Design notes: DESIGN.md#tailpy
"""

import collections
import enum
import math

from task import Problem


class Round(enum.StrEnum):
    PLAIN = "plain"     # tail batching off
    SHORT = "short"     # over-sampled; what is not done in time is deferred to the long queue
    LONG = "long"       # the long queue's prompts, run to full length


class TailBatcher:
    def __init__(self, batch_groups: int, async_ratio: int, oversample: float, extra_samples: int):
        self.B, self.alpha = batch_groups, async_ratio
        self.oversample, self.extra_samples = oversample, extra_samples
        self.round = Round.SHORT
        self.long_queue: collections.deque[Problem] = collections.deque()
        self.admitted_at: dict[str, int] = {}    # unresolved group -> the version it was admitted at
        self.long: set[str] = set()              # unresolved groups admitted in a long round
        self.deferred = 0                        # prompts moved to the long queue, over the run
        self.long_dropped = 0                    # long groups still running after alpha + 1 versions

    def begin_step(self) -> Round:
        self.round = Round.LONG if len(self.long_queue) >= self.B else Round.SHORT
        return self.round

    def target(self, redundant: int) -> int:
        """Groups in flight (admitted, neither taken nor lost) allowed in this round."""
        if self.round == Round.LONG:
            return (self.alpha + 1) * self.B
        return (self.alpha + 1) * self.B + math.ceil((self.oversample - 1) * self.B) + redundant

    def long_block(self) -> int:
        """How many long-queue prompts a long round admits at its start, whatever is in flight."""
        return min(self.B, len(self.long_queue)) if self.round == Round.LONG else 0

    def next_problem(self) -> Problem | None:
        """A long round's next prompt from the long queue (None: take the stream's)."""
        if self.round == Round.LONG and self.long_queue:
            return self.long_queue.popleft()
        return None

    def samples_per_group(self, group_size: int, single_turn: bool) -> int:
        extra = self.extra_samples if single_turn and self.round == Round.SHORT else 0
        return group_size + extra

    def admitted(self, gid: str, version: int):
        self.admitted_at[gid] = version
        if self.round == Round.LONG:
            self.long.add(gid)

    def resolved(self, gid: str):
        """The group was trained or lost (filtered, failed, stale): forget it."""
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

    def pending_long(self, problem_of: dict[str, Problem]) -> list[Problem]:
        """For a checkpoint: long groups in flight, then the long queue (a resumed run queues them again)."""
        return [problem_of[g] for g in self.long if g in problem_of] + list(self.long_queue)
