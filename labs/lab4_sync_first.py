"""Lab 4: an admission policy, measured in the simulator: synchronous for the first n steps, then async.

Early in training the policy moves fast, so stale samples are the most off-policy there; a run may
want its first steps synchronous (every sample of the current weights) and only then let rollout run
ahead by the async ratio. Which prompts run, and when, is the controller's `controller.Admission`
policy: it is asked `capacity(ctrl)` (how many more groups may be admitted now) before every admission,
and the controller admits max(0, that many).

Implement SyncFirst.capacity: while the run has trained fewer than `n` steps, the synchronous bound
(async ratio 0: B groups plus `redundant`); from then on the async ratio's bound, as
`controller.Admission.capacity` computes it. Both less the groups already holding places
(`controller.AsyncController.groups_holding_places`, your lab 1's `holding`).

Count the steps trained as `ctrl.version - ctrl.version0`: `ctrl.version` is the trainer's policy version, one
more per step, and `ctrl.version0` the version the run started at (a resumed run starts at its checkpoint's,
not at 0). docs/tour.md's section 1 is admission. Read `controller.Admission` (its methods and when the
controller calls them) and `ext/tail_batching.py`'s TailBatching (a whole policy).

The freshness rule stays at the async ratio. With no redundant prompts (the grader's setting) a
synchronous step has no older work in flight, so every sample it trains is of the current version. To
think about: with --redundant R > 0, the redundant groups still running when a step's batch is complete
are fresh under the ratio, and train in the next step one version old. What would make those first steps
strictly synchronous? (Hint: lab 1's `buffer.Freshness`, and its `end_step`.)

The grader installs your policy in tools/sim.py's simulator (the real controller, env managers and proxies
over a timed fake engine, in virtual time) and measures: the staleness of each step, the places held, the
seconds per step against the synchronous and the asynchronous runs, and a resumed run.

    .venv/bin/python -m pytest labs/lab4_sync_first_test.py -s      # -s: print the measurements
"""

from controller import Admission


class SyncFirst(Admission):
    def __init__(self, cfg, n: int):
        super().__init__(cfg)
        self.n = n                     # synchronous steps first

    def capacity(self, ctrl) -> int:
        raise NotImplementedError("lab 4: SyncFirst.capacity()")
