"""What a grader grades: the student's stub, or another module named by the LAB_IMPL environment variable.

    .venv/bin/python -m pytest labs/lab1_freshness_test.py                  # grades labs/lab1_freshness.py
    LAB_IMPL=solutions .venv/bin/python -m pytest labs/                       # every reference solution
    LAB_IMPL=labs.solutions.lab1_freshness .venv/bin/python -m pytest labs/lab1_freshness_test.py
"""

import importlib
import os


def load(lab: str):
    """The module under test for `lab` (e.g. "lab1_freshness"): LAB_IMPL's module ("solutions": the
    reference solution of this lab), else the student's labs/<lab>.py."""
    name = os.environ.get("LAB_IMPL", "").strip() or f"labs.{lab}"
    if name == "solutions":
        name = f"labs.solutions.{lab}"
    return importlib.import_module(name)
