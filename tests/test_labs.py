"""labs/: every grader passes on its reference solution (labs/solutions/: the project's own code, or
README.md's Fork it code) and fails on the student's stub, every test of it, in the grader's assertions or
the stub's NotImplementedError, never in an import or collection error. Each grader runs as a teacher runs
it: pytest in a subprocess, the implementation chosen by LAB_IMPL (labs/grading.py); a lab's two runs go
side by side."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABS = ["lab1_freshness", "lab2_ppo_clip", "lab3_retry_env", "lab4_sync_first", "lab5_lag_loss"]


def grade(lab: str, impl: str, report: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               f"labs/{lab}_test.py"]
    env = {**os.environ, "LAB_IMPL": impl, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}   # (no plugins: faster)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def outcomes(report: Path) -> list[tuple[str, str, str]]:
    """(test name, outcome, the failure's message and traceback) of each test case in a JUnit report."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [e for e in case if e.tag in ("failure", "error", "skipped")]
        out.append((case.get("name"), bad[0].tag if bad else "passed",
                    (bad[0].get("message", "") + "\n" + (bad[0].text or "")) if bad else ""))
    return out


@pytest.mark.parametrize("lab", LABS)
def test_the_solution_passes_and_the_stub_fails(lab, tmp_path):
    runs = {which: (grade(lab, impl, tmp_path / f"{which}.xml"), tmp_path / f"{which}.xml")
            for which, impl in (("solution", f"labs.solutions.{lab}"), ("stub", f"labs.{lab}"))}
    try:
        logs = {which: p.communicate(timeout=300)[0] for which, (p, _) in runs.items()}
    finally:
        for p, _ in runs.values():
            if p.poll() is None:           # (timed out: end it, not leave it running)
                p.kill()
    (solution, solution_xml), (stub, stub_xml) = runs["solution"], runs["stub"]
    assert solution.returncode == 0, f"{lab}'s reference solution fails:\n{logs['solution'][-3000:]}"
    assert len(outcomes(solution_xml)) >= 4 and all(o == "passed" for _, o, _ in outcomes(solution_xml))
    assert stub.returncode == 1, f"{lab}'s stub: pytest exit code {stub.returncode}:\n{logs['stub'][-3000:]}"
    for name, outcome, why in outcomes(stub_xml):
        assert outcome == "failure", f"{lab}'s stub: {name} {outcome}, want every test failed:\n{why[-2000:]}"
        assert "NotImplementedError" in why or "AssertionError" in why, (
            f"{lab}'s stub: {name} failed for another reason than the grader's:\n{why[-2000:]}")
