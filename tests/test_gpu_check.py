"""tools/gpu_check.py, the one-GPU check, kept from rotting: its tiny mode runs every check on CPU here
(the same code as on a GPU, with vLLM made unimportable as on the GPU image), a failing check is recorded
while the others still run, and a check can fail (a resume that loses the optimizer state is caught)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tools import gpu_check

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["build", "ipc", "fsdp", "stream", "logprobs", "train_tiny", "memplan_tiny", "throughput_tiny",
          "no_vllm"]


def run_tiny(out: Path, *args: str, code: str = "") -> subprocess.CompletedProcess:
    """python -m tools.gpu_check --tiny ... (code: run first, in the same process: a patch)."""
    argv = ["--tiny", "--out", str(out), *args]
    main = f"{code}\nimport sys, tools.gpu_check as g\nsys.exit(g.main({argv!r}))"
    return subprocess.run([sys.executable, "-c", main], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_tiny_mode_runs_every_check_on_cpu_without_vllm(tmp_path):
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--tiny", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = json.loads(out.read_text())
    failed = {k: v.get("error") for k, v in report["checks"].items() if v["status"] != "pass"}
    assert r.returncode == 0 and not failed, (failed, r.stdout[-3000:], r.stderr[-3000:])
    assert list(report["checks"]) == CHECKS and report["passed"]
    assert report["environment"]["device"] == "cpu"
    c = report["checks"]
    assert c["ipc"]["bit_exact"] and c["ipc"]["largest_bytes"] > c["ipc"]["bucket_bytes"]
    assert c["fsdp"]["masters"] == ["torch.float32"] and c["fsdp"]["compute_dtype"] == "torch.bfloat16"
    assert c["fsdp"]["next_step_rel_diff"] < 0.05
    assert c["memplan_tiny"]["measured_over_plan"]["AdamW moments"] == 1.0
    # one summary line per check on stdout, then the verdict
    assert [line.split()[1] for line in r.stdout.splitlines() if line.startswith("PASS")] == CHECKS
    assert r.stdout.splitlines()[-1].startswith("gpu_check: 9/9 checks passed on cpu")


def test_a_resume_that_loses_the_optimizer_state_fails_the_fsdp_check(tmp_path):
    out = tmp_path / "report.json"
    r = run_tiny(out, "--only", "fsdp",
                 code="import trainer; trainer.Trainer.load_optimizer = lambda self, path: None")
    report = json.loads(out.read_text())
    assert r.returncode == 1 and list(report["checks"]) == ["build", "fsdp"]
    assert report["checks"]["fsdp"]["status"] == "fail"
    assert "the resumed step differs from the original's" in report["checks"]["fsdp"]["error"]


def test_a_failing_check_is_recorded_and_the_others_still_run(tmp_path):
    def good(ctx, rec):
        rec["summary"] = "fine"

    def bad(ctx, rec):
        rec["measured"] = 42                 # what it measured before failing stays in the report
        raise AssertionError("off by 3x")
    ctx = gpu_check.Ctx("tiny", tmp_path)
    out = tmp_path / "r.json"
    report = gpu_check.run(ctx, out, budget_s=600, todo=[("a", good), ("b", bad), ("c", good)])
    assert json.loads(out.read_text())["checks"] == json.loads(json.dumps(report["checks"]))
    a, b, c = (report["checks"][k] for k in "abc")
    assert a["status"] == c["status"] == "pass" and not report["passed"]
    assert b["status"] == "fail" and b["error"] == "AssertionError: off by 3x" and b["measured"] == 42
    assert "raise AssertionError" in b["traceback"]
    # past the time budget, checks are skipped, and say so
    late = gpu_check.run(ctx, out, budget_s=-1, todo=[("a", good)])
    assert late["checks"]["a"] == {"status": "skipped", "error": "the -1s budget was spent"}
