"""labs/: every grader passes on its reference solution (labs/solutions/) and fails on the student's stub,
every test of it, in the grader's assertions or the stub's NotImplementedError, never in an import or
collection error; and on plausible wrong answers (below, WRONG: each the solution with one mistake a student
makes) it fails within 60 s, with a message that says in words what is wrong. Each grader runs as a teacher
runs it: pytest in a subprocess, the implementation chosen by LAB_IMPL (labs/grading.py), two side by side."""

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABS = ["lab1_freshness", "lab2_ppo_clip", "lab3_retry_env", "lab4_sync_first", "lab5_lag_loss",
        "lab6_weight_sync"]
LIMIT_S = 60           # a grader's hard time limit on a wrong answer (the check)


# Wrong answers: (name, the module's source, words that a failure's message must contain). Each module
# imports the rest of the reference solution, so it has exactly one mistake.
WRONG = {
    "lab1_freshness": [
        ("fresh-off-by-one", """
            from labs.solutions.lab1_freshness import capacity
            def fresh(oldest_version, version, async_ratio):
                return version - oldest_version < async_ratio          # > for >=: lag alpha is stale
         """, "fresh(oldest_version="),
        ("capacity-forgets-redundant", """
            from labs.solutions.lab1_freshness import fresh
            def capacity(async_ratio, batch_groups, redundant, holding):
                return (async_ratio + 1) * batch_groups - holding
         """, "redundant="),
    ],
    "lab2_ppo_clip": [
        ("clip-mask-by-range", """
            import torch
            from labs.solutions.lab2_ppo_clip import ppo_token_loss as right
            def ppo_token_loss(r, A, clip_low, clip_high, dual_clip):
                loss, _ = right(r, A, clip_low, clip_high, dual_clip)
                return loss, (r < 1 - clip_low) | (r > 1 + clip_high)   # outside the range, whatever A says
         """, "clipped is True, want False"),
        ("dual-clip-sign", """
            import torch
            def ppo_token_loss(r, A, clip_low, clip_high, dual_clip):
                unclipped, clipped_term = -r * A, -r.clamp(1 - clip_low, 1 + clip_high) * A
                loss, clipped = torch.maximum(unclipped, clipped_term), clipped_term > unclipped
                if dual_clip:
                    dual = (A < 0) & (loss > dual_clip * A)                 # the bound's sign flipped
                    loss, clipped = torch.where(dual, dual_clip * A, loss), clipped | dual
                return loss, clipped
         """, "dual_clip=3.0"),
    ],
    "lab3_retry_env": [
        ("reward-not-halved", """
            from labs.solutions.lab3_retry_env import ENVS, RetryEnv, score
            class Full(RetryEnv):
                async def step(self, action):
                    self.tries += 1
                    r = await score(self.problem, action, self.reward_fn)
                    if r == 1.0 or self.tries == 2:
                        return "", r, True, {}
                    return " no. again:\\n", 0.0, False, {}
            ENVS["retry"] = lambda problem, seed, reward_fn=None: Full(problem, reward_fn)
         """, "want (0.5, True)"),
        ("ignores-the-runs-verifier", """
            import task
            from labs.solutions.lab3_retry_env import ENVS, RetryEnv
            class Own(RetryEnv):
                async def step(self, action):
                    self.tries += 1
                    r = task.reward(self.problem, action)                  # not the run's reward_fn
                    if r == 1.0 or self.tries == 2:
                        return "", r / self.tries, True, {}
                    return " no. again:\\n", 0.0, False, {}
            ENVS["retry"] = lambda problem, seed, reward_fn=None: Own(problem, reward_fn)
         """, "verifier"),
    ],
    "lab4_sync_first": [
        ("counts-from-zero", """
            from labs.solutions.lab4_sync_first import SyncFirst as Right
            class SyncFirst(Right):
                def capacity(self, ctrl):
                    if ctrl.version >= self.n:                             # not ctrl.version - ctrl.version0
                        return super(Right, self).capacity(ctrl)
                    return self.cfg.batch_groups + self.cfg.redundant - ctrl.groups_holding_places()
         """, "ctrl.version0"),
        ("sync-bound-forgets-redundant", """
            from labs.solutions.lab4_sync_first import SyncFirst as Right
            class SyncFirst(Right):
                def capacity(self, ctrl):
                    if ctrl.version - ctrl.version0 >= self.n:
                        return super(Right, self).capacity(ctrl)
                    return self.cfg.batch_groups - ctrl.groups_holding_places()
         """, "redundant"),
        ("never-subtracts-the-places-held", """
            from labs.solutions.lab4_sync_first import SyncFirst as Right
            class SyncFirst(Right):
                def capacity(self, ctrl):
                    alpha = 0 if ctrl.version - ctrl.version0 < self.n else ctrl.freshness.max_lag
                    return (alpha + 1) * self.cfg.batch_groups + self.cfg.redundant
         """, "places"),
    ],
    "lab5_lag_loss": [
        ("not-registered", """
            from labs.solutions.lab5_lag_loss import LagParams, lag_ppo
            from losses import LOSSES
            del LOSSES["lag_ppo"]                                          # (the solution registered it)
         """, "register it"),
        ("decay-times-lag", """
            from losses import LOSSES, loss, ppo
            from labs.solutions.lab5_lag_loss import LagParams
            @loss(hparams=LagParams)
            def lag_ppo(t):
                loss_tok, extra = ppo(t)
                return t.hp["lag_decay"] * t.lag * loss_tok, extra         # * for **
            LOSSES["lag_ppo"] = lag_ppo
         """, "by hand"),
    ],
    "lab6_weight_sync": [
        ("labels-every-token-with-the-last-version", """
            from labs.solutions.lab6_weight_sync import resubmission
            def token_versions(spans, n, submitted):
                v = spans[-1][0] if spans else None
                return [submitted if v is None else v] * n
         """, "token_versions(spans="),
        ("restarts-from-the-prompt", """
            from labs.solutions.lab6_weight_sync import token_versions
            def resubmission(prompt_ids, token_ids, max_tokens):
                return prompt_ids, max_tokens
         """, "resubmission(prompt_ids="),
    ],
}


@dataclasses.dataclass
class Run:
    """One grader run: pytest on labs/<lab>_test.py in a subprocess, LAB_IMPL = impl."""
    lab: str
    impl: str
    report: Path
    path: str = ""                 # a folder to put on PYTHONPATH (a wrong answer's module)
    proc: subprocess.Popen | None = None
    log: str = ""
    seconds: float = 0.0

    def start(self):
        env = {**os.environ, "LAB_IMPL": self.impl, "PYTHONPATH": os.pathsep.join(
            filter(None, [self.path, str(ROOT), os.environ.get("PYTHONPATH", "")])),
               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}                       # (no plugins: faster)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                      f"--junitxml={self.report}", f"labs/{self.lab}_test.py"],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)

    def finish(self, timeout: float):
        try:
            self.log = self.proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - self.t0)))[0]
        except subprocess.TimeoutExpired:
            self.proc.kill()                 # (the run's own process; its output up to now is kept)
            self.log = self.proc.communicate()[0] + f"\n[killed after {timeout:.0f} s]"
        self.seconds = time.monotonic() - self.t0

    def outcomes(self) -> list[tuple[str, str, str]]:
        """(test name, outcome, the failure's message and traceback) of each test case in the JUnit report."""
        out = []
        for case in ET.parse(self.report).getroot().iter("testcase"):
            bad = [e for e in case if e.tag in ("failure", "error", "skipped")]
            out.append((case.get("name"), bad[0].tag if bad else "passed",
                        (bad[0].get("message", "") + "\n" + (bad[0].text or "")) if bad else ""))
        return out


def run_all(runs: list[Run], timeout: float, parallel: int = 2) -> list[Run]:
    """The runs, `parallel` at a time (the machine's 2 cores), each killed at `timeout` seconds."""
    for i in range(0, len(runs), parallel):
        for r in runs[i:i + parallel]:
            r.start()
        for r in runs[i:i + parallel]:
            r.finish(timeout)
    return runs


@pytest.mark.parametrize("lab", LABS)
def test_the_solution_passes_and_the_stub_fails(lab, tmp_path):
    solution, stub = run_all([Run(lab, f"labs.solutions.{lab}", tmp_path / "solution.xml"),
                              Run(lab, f"labs.{lab}", tmp_path / "stub.xml")], timeout=300)
    assert solution.proc.returncode == 0, f"{lab}'s reference solution fails:\n{solution.log[-3000:]}"
    assert len(solution.outcomes()) >= 4 and all(o == "passed" for _, o, _ in solution.outcomes())
    assert stub.proc.returncode == 1, (
        f"{lab}'s stub: pytest exit code {stub.proc.returncode}:\n{stub.log[-3000:]}")
    for name, outcome, why in stub.outcomes():
        assert outcome == "failure", f"{lab}'s stub: {name} {outcome}, want every test failed:\n{why[-2000:]}"
        assert "NotImplementedError" in why or "AssertionError" in why, (
            f"{lab}'s stub: {name} failed for another reason than the grader's:\n{why[-2000:]}")


BARE = re.compile(r"^(AssertionError: )?[\s(\[{0-9.,'\")\]}-]*$")       # a message of no words: "(27, 30, 3)"


@pytest.mark.parametrize("lab", LABS)
def test_each_wrong_answer_fails_fast_and_says_why(lab, tmp_path):
    """Each of WRONG[lab] fails its grader within LIMIT_S seconds; every failed test's message has words,
    and one of them names the mistake's case (the words WRONG gives)."""
    runs = []
    for name, source, _ in WRONG[lab]:
        module = f"wrong_{lab}_{name.replace('-', '_')}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        runs.append(Run(lab, module, tmp_path / f"{module}.xml", path=str(tmp_path)))
    for run, (name, _, words) in zip(run_all(runs, timeout=LIMIT_S), WRONG[lab]):
        assert run.seconds < LIMIT_S and run.report.exists(), (
            f"{lab}, wrong answer {name!r}: the grader did not finish within {LIMIT_S} s:\n{run.log[-3000:]}")
        assert run.proc.returncode == 1, (
            f"{lab}, wrong answer {name!r}: pytest exit code {run.proc.returncode}, want 1 (tests failed):\n"
            f"{run.log[-3000:]}")
        failed = [(test, why) for test, outcome, why in run.outcomes() if outcome != "passed"]
        for test, why in failed:
            first = why.strip().splitlines()[0] if why.strip() else ""
            assert len(re.findall(r"[a-z]{2,}", first)) >= 4 and not BARE.match(first), (
                f"{lab}, wrong answer {name!r}: {test} fails without saying why in words: {first!r}")
        assert any(words in why for _, why in failed), (
            f"{lab}, wrong answer {name!r}: no failure names the case ({words!r}); the failures:\n"
            + "\n".join(f"{test}: {why.strip().splitlines()[0]}" for test, why in failed))


def test_the_cap_stops_a_simulated_run_in_which_nothing_is_ever_fresh():
    """labs/grading.Cap: a rule under which no sample is fresh (lab 1's off-by-one at ratio 0) no longer runs
    the simulator for hours; the run fails within seconds, saying how far it got."""
    from buffer import Freshness
    from labs.grading import Cap
    from tools.sim import SimConfig, simulate

    class Never(Freshness):
        def fresh(self, oldest_version, version, group_id=""):
            return version - oldest_version < self.max_lag

    def setup(ctrl):
        ctrl.freshness = Never(0)
        Cap(ctrl, steps=4, seconds=10)
    cfg = SimConfig(rollout_gpus=2, train_gpus=1, batch_groups=4, group_size=4, redundant=2, max_num_seqs=8,
                    async_ratio=0, steps=4, warmup=1)
    with pytest.raises(AssertionError, match=r"stopped by the grader's cap .* 0 of 4 steps trained"):
        simulate(cfg, setup=setup)
