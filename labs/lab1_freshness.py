"""Lab 1: the freshness rule and the admission capacity, the two numbers that make rollout asynchronous.

The trainer at version v trains the update that makes v + 1. With async ratio alpha a sample may train it
only if its oldest token came from a policy no older than v - alpha (alpha = 0: the synchronous baseline,
every sample of the current weights). Rollout never waits for training, so it must be kept from running
too far ahead: admission lets at most (alpha + 1) * B groups hold places (B groups a step), plus
`redundant` extra groups that dynamic filtering burns. A group holds a place from its admission until it
is lost, filtered, or trained by an earlier step.

Implement both functions below. docs/tour.md's sections 1 (admission) and 4 (freshness) tell the story;
read for inspiration:
- `buffer.Freshness.fresh`: the rule, the one place it lives in the project; `buffer.GroupAssembler.add`
  and `take` drop the samples that fail it, and `env_manager.EnvManager._sync` aborts running work that
  can no longer pass it.
- `controller.Admission.capacity`: the bound, and `controller.AsyncController.groups_holding_places`: what
  it subtracts; `controller.AsyncController.admit` admits max(0, capacity) groups.

Why both matter together: the rule alone would let rollout run arbitrarily far ahead and then throw the
work away as stale; the capacity alone would not stop an old sample from training. The grader checks each
function on tables of cases, then plugs both into the real controller (a `buffer.Freshness` subclass and
a `controller.Admission` subclass) and runs tools/sim.py's simulator: no trained sample may lag more than
alpha, and the groups holding places must reach, and never exceed, the bound.

    .venv/bin/python -m pytest labs/lab1_freshness_test.py
"""


def fresh(oldest_version: int, version: int, async_ratio: int) -> bool:
    """May a sample whose oldest token came from policy `oldest_version` train the trainer at `version`
    (the update that makes version + 1) under async ratio `async_ratio`?"""
    raise NotImplementedError("lab 1: fresh()")


def capacity(async_ratio: int, batch_groups: int, redundant: int, holding: int) -> int:
    """How many more groups may be admitted now: the bound for this async ratio, B = batch_groups and
    `redundant` extra groups, less the `holding` groups that already hold a place. (The controller admits
    max(0, this), so a value at or below 0 admits nothing.)"""
    raise NotImplementedError("lab 1: capacity()")
