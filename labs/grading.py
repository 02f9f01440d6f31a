"""What a grader grades (the student's stub, or another module named by the LAB_IMPL environment
variable), and the cap that keeps a simulated run with the student's code in it from running forever.

    .venv/bin/python -m pytest labs/lab1_freshness_test.py                  # grades labs/lab1_freshness.py
    LAB_IMPL=solutions .venv/bin/python -m pytest labs/                       # every reference solution
    LAB_IMPL=labs.solutions.lab1_freshness .venv/bin/python -m pytest labs/lab1_freshness_test.py
"""

import importlib
import os
import time


def load(lab: str):
    """The module under test for `lab` (e.g. "lab1_freshness"): LAB_IMPL's module ("solutions": the
    reference solution of this lab), else the student's labs/<lab>.py."""
    name = os.environ.get("LAB_IMPL", "").strip() or f"labs.{lab}"
    if name == "solutions":
        name = f"labs.solutions.{lab}"
    return importlib.import_module(name)


class Cap:
    """A step and time cap on one simulated run (tools/sim.py) whose admission policy is the student's: the
    controller asks the policy's capacity() before every admission, and from the moment the run has taken
    `seconds` of real time, or admitted `groups` groups, that call fails the test saying how far the run got.
    Without it a rule under which no sample is ever fresh (every group dropped, admitted again, dropped ...)
    runs the simulator for hours of virtual time. Install it in the simulator's setup(ctrl), after the
    policy: Cap(ctrl, steps=cfg.steps)."""

    def __init__(self, ctrl, steps: int, seconds: float = 20.0, groups: int | None = None):
        self.ctrl, self.steps, self.seconds, self.t0 = ctrl, steps, seconds, time.monotonic()
        self.bound = bound = (ctrl.freshness.max_lag + 1) * ctrl.cfg.batch_groups + ctrl.cfg.redundant
        self.groups = groups or 20 * bound * steps        # a correct policy admits a few bounds' worth
        policy = ctrl.admission
        capacity = policy.capacity

        def checked(c) -> int:
            n = capacity(c)
            if not isinstance(n, int):
                raise AssertionError(f"capacity() returned {n!r}, not an int (how many groups may start)")
            self.check()
            return n
        policy.capacity = checked                          # (this policy object only)

    def check(self):
        ctrl, t = self.ctrl, time.monotonic() - self.t0
        if t <= self.seconds and ctrl.groups_admitted <= self.groups:
            return
        a = ctrl.assembler
        raise AssertionError(
            f"the simulated run was stopped by the grader's cap ({self.seconds:.0f} s of real time or "
            f"{self.groups} groups admitted) after {t:.1f} s: {ctrl.groups_admitted} groups admitted, "
            f"{ctrl.version - ctrl.version0} of {self.steps} steps trained, {a.groups_dropped_stale} groups "
            f"dropped as stale, {a.groups_filtered} filtered, {ctrl.groups_holding_places()} holding "
            f"places now (the async ratio's bound: {self.bound}). Groups that are never fresh, or an "
            f"admission that never stops, look like this")
