"""Every `python -m tools.NAME` that README.md and results/README.md cite has a smoke test: the command's own
code at tiny settings, asserting on the table or JSON it produces, so that a refactor of the core cannot
silently break the command behind a table again (bench_e2e's naive baseline once called
RolloutConfig.resolved with an argument it no longer took, and no test ran it). CITED maps each cited
command to its tests; test_every_cited_command_has_a_smoke_test fails on a citation without one.

This file: the guard, and the tools that need no engine and no train.py job (bench_agent calls,
bench_trainer, the simulator's experiments that tests/test_sim.py does not run, profile_step's report,
bench_rollout --before). Those that start engines: tests/test_tools_engines.py; those that launch
train.py jobs: tests/test_tools_runs.py."""

import ast
import json
import re
from pathlib import Path

import pytest

from toolrun import finite, last_json, run_tool

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "results/README.md")

# a cited command -> the tests that run its code, one pair a line. A command is the tool, then its subcommand
# if it has any, then the flags of MODES that the citation uses (each picks another code path of the tool).
CITED_TESTS = """
bench                          | test_tools_engines.py::test_bench_runs_every_configuration_on_real_engines
bench_agent calls              | test_tools_smoke.py::test_bench_agent_calls_measures_each_arm
bench_agent train              | test_tools_runs.py::test_bench_agent_train_runs_the_env_and_the_agent
bench_e2e                      | test_tools_runs.py::test_bench_e2e_naive_sync_and_async
bench_e2e --env                | test_tools_runs.py::test_bench_e2e_agentic_lockstep_and_system
bench_e2e --rollpacker         | test_tools_runs.py::test_bench_e2e_rollpacker_runs_its_five
bench_lora                     | test_tools_runs.py::test_bench_lora_compares_full_and_lora_runs
bench_proxy                    | test_tools_engines.py::test_bench_proxy_throughput_and_weight_update
bench_rollout                  | test_bench_rollout.py::test_bench_rollout_measures_each_stream_interval
bench_rollout --before         | test_tools_smoke.py::test_bench_rollout_before_compares_two_trees
bench_rollout --real           | test_tools_engines.py::test_bench_rollout_real_raw_and_through_the_proxy
bench_trainer checkpointing    | test_tools_smoke.py::test_bench_trainer_cases_on_the_tiny_model
bench_trainer logprobs         | test_tools_smoke.py::test_bench_trainer_logprobs_runs_each_case_in_a_process
bench_trainer memplan          | test_tools_smoke.py::test_bench_trainer_cases_on_the_tiny_model
bench_trainer packing          | test_tools_smoke.py::test_bench_trainer_packing
bench_trainer start            | test_tools_smoke.py::test_bench_trainer_cases_on_the_tiny_model
bench_weight_sync --before     | test_tools_runs.py::test_bench_weight_sync_transports_and_before
bench_weight_sync --transports | test_tools_runs.py::test_bench_weight_sync_transports_and_before
core_lines                     | test_core_lines.py::test_the_tool_counts_every_root_module
distill_study                  | test_distill.py::test_distill_study_writes_its_three_tables
domains_study                  | test_domains.py::test_the_study_writes_its_tables_from_its_runs
gpu_check                      | test_gpu_check.py::test_tiny_mode_runs_every_check_on_cpu_without_vllm
judge_study                    | test_judge.py::test_judge_study_writes_its_tables
plot                           | test_plot.py::test_the_command_line_takes_the_run_dir
plot --compare                 | test_plot.py::test_plot_writes_the_pngs_with_their_panels
profile_step                   | test_tools_smoke.py::test_profile_step_splits_each_process_over_its_phases
profile_step                   | test_tools_smoke.py::test_profile_step_rules_name_code_that_exists
sim                            | test_tools_smoke.py::test_sim_experiment
sim all                        | test_tools_smoke.py::test_sim_experiment
sim all                        | test_sim.py::test_the_committed_table_is_what_the_simulator_prints
sim calibrate                  | test_tools_smoke.py::test_sim_experiment
sim envasync                   | test_sim.py::test_the_committed_table_is_what_the_simulator_prints
sim queue                      | test_sim.py::test_the_committed_table_is_what_the_simulator_prints
sim ratio                      | test_tools_smoke.py::test_sim_experiment
sim replication                | test_tools_smoke.py::test_sim_experiment
sim rollpacker                 | test_tools_smoke.py::test_sim_experiment
sim scaling                    | test_tools_smoke.py::test_sim_experiment
sim split                      | test_tools_smoke.py::test_sim_experiment
sim sweep                      | test_tools_smoke.py::test_sim_experiment
sim_vs_real                    | test_tools_engines.py::test_sim_vs_real_calibrates_and_compares
soak                           | test_tools_runs.py::test_soak_watches_a_faulty_run_and_finds_no_leak
study                          | test_study.py::test_study_runs_and_writes_its_table_and_plot
tail_learning                  | test_tools_runs.py::test_tail_learning_writes_its_table_and_plot
"""
CITED: dict[str, list[str]] = {}
for line in filter(None, CITED_TESTS.splitlines()):
    command, test = (x.strip() for x in line.split("|"))
    CITED.setdefault(command, []).append(test)
MODES = {"bench_e2e": ("--env", "--rollpacker"), "bench_rollout": ("--before", "--real"),
         "bench_weight_sync": ("--before", "--transports"), "plot": ("--compare",)}
SUBCOMMANDS = ("bench_agent", "bench_trainer", "sim")


def cited_commands() -> dict[str, str]:
    """command (as CITED names them) -> where the docs cite it first."""
    out = {}
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        # `python -m tools.NAME ARGS`, ARGS up to the end of the code span or line (a citation may wrap)
        for m in re.finditer(r"python -m\s+tools\.(\w+)([^`\n]*)", text):
            tool, args = m.group(1), m.group(2).split()
            if tool == "NAME":                 # (README's "python -m tools.NAME": the pattern, not a tool)
                continue
            key = tool
            if tool in SUBCOMMANDS and args and not args[0].startswith("-"):
                key += f" {args[0]}"
            key += "".join(f" {flag}" for flag in MODES.get(tool, ()) if flag in args)
            out.setdefault(key, f"{doc}:{text.count(chr(10), 0, m.start()) + 1}")
    return out


def test_every_cited_command_has_a_smoke_test():
    cited = cited_commands()
    assert len(cited) >= 30, sorted(cited)           # (the pattern still finds the citations)
    missing = {k: where for k, where in cited.items() if k not in CITED}
    assert not missing, f"cited, with no smoke test in CITED (tests/test_tools_smoke.py): {missing}"
    for command, tests in CITED.items():             # every test named is there
        for test in tests:
            file, name = test.split("::")
            tree = ast.parse((ROOT / "tests" / file).read_text())
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert name in names, f"CITED[{command!r}]: no {test}"


# ---------------------------------------------------------------------------------------------
# bench_agent calls: the fake engine, in process


def test_bench_agent_calls_measures_each_arm(tmp_path):
    path = tmp_path / "calls.json"
    run_tool("tools.bench_agent", ["calls", "--trajectories", "4", "--concurrency", "2", "--repeats", "1",
                                   "--out", str(path)])
    res = json.loads(path.read_text())
    assert set(res["runs"]) == {"env", "agent", "agent-http"}
    for kind, [r] in res["runs"].items():
        # the calculator protocol: a call, then its value as the answer (right): two model calls each
        assert (r["model_calls"], r["reward_mean"]) == (8, 1.0), kind
        assert finite(r["cpu_ms_per_call"], r["latency_ms_per_call"], r["engine_ms_per_call"]), kind
    assert finite(*res["agent_over_env"].values(), *res["http_over_in_process"].values())


# ---------------------------------------------------------------------------------------------
# bench_trainer: its cases on small sizes and the tiny model


def test_bench_trainer_packing():
    res = last_json(run_tool("tools.bench_trainer", ["packing", "--samples", "64"]))
    old, new = res["--micro-batch 8"], res["--max-tokens-per-micro 32768"]
    assert old["count"] == 8 and 0 < new["padded_share"] < old["padded_share"] < 1


def test_bench_trainer_logprobs_runs_each_case_in_a_process():
    """Each case in a fresh process (run_case: `python -m tools.bench_trainer _case ...`), as the command."""
    out = run_tool("tools.bench_trainer", ["logprobs", "--batch", "2", "--old-batch", "1", "--seq", "64",
                                           "--vocab", "512"])
    res = last_json(out)
    assert set(res["full"]) == {"1"} and set(res["chunked"]) == {"2"}
    assert finite(res["full"]["1"]["peak_mib"], res["chunked"]["2"]["peak_mib"])
    assert "| 2 x 64 |" in out and "(extrapolated)" in out        # B 2 today's way: from B 1


def test_bench_trainer_cases_on_the_tiny_model(tiny_model_dir, capsys):
    """checkpointing, start and memplan with --model (the tiny model), each case in its own process as
    the command runs it (a measurement in this process would count the other tests' memory)."""
    from tools import bench_trainer
    model = str(tiny_model_dir)
    res = bench_trainer.main(["checkpointing", "--tokens", "2048", "--seq", "256", "--model", model])
    assert res[False]["activations_mib"] > res[True]["activations_mib"] >= 0
    res = bench_trainer.main(["start", "--model", model])
    for mode in ("full", "sharded"):
        shards = [res[mode][f"rank{r}"]["shard_mib"] for r in (0, 1)]     # each rank its half of the model
        assert shards[0] == shards[1]
        assert sum(shards) == pytest.approx(bench_trainer.model_mib(model), rel=0.1)
        assert finite(*(res[mode][f"rank{r}"]["anon_peak_mib"] for r in (0, 1))), mode
    res = bench_trainer.main(["memplan", "--ranks", "1", "--rows", "2", "--seq", "64", "--model", model])
    plan, got = res[1]["plan"], res[1]["measured"]
    assert plan["weights (fp32 masters)"] == got["weights"] and plan["gradients"] == got["gradients"]
    assert finite(got["total_peak"]) and got["total_peak"] > 0
    out = capsys.readouterr().out
    assert "tiny-qwen2 model" in out and "| start-up, tiny-qwen2 (fp32" in out
    assert "| total (peak of a step) |" in out


# ---------------------------------------------------------------------------------------------
# the simulator: the experiments test_sim.py does not run, at a few samples per GPU


@pytest.mark.parametrize("name", ["replication", "scaling", "split", "ratio", "calibrate", "rollpacker",
                                  "sweep"])
def test_sim_experiment(name, tmp_path, monkeypatch, capsys):
    from tools import sim
    monkeypatch.setattr(sim, "RESULTS", tmp_path)
    monkeypatch.setattr(sim, "SAMPLES_PER_GPU", 4)           # (the weak-scaling batch: 64 per GPU)
    sim.main([name, "--steps", "2", "--warmup", "1", "--chunk", "1024",
              *(["--gpus", "8"] if name == "rollpacker" else [])])
    table = (tmp_path / f"{name}.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 3, table                           # the header and at least two runs
    cells = [c.strip() for row in rows[1:] for c in row.strip("|").split("|")]
    assert not any(c in ("nan", "inf") for c in cells), table
    assert (tmp_path / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    assert f"python -m tools.sim {name}" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# profile_step: the report from py-spy's samples (py-spy itself is not in requirements.txt)


def profile_raw(stacks: dict) -> str:
    """py-spy's raw output (`record --subprocesses --format raw`): per line, the process frame, the stack
    (function (file:line) frames, outermost first) and the sample count."""
    return "\n".join(f'process {pid}:"{cmd}";' + ";".join(frames) + f" {n}"
                     for (pid, cmd), rows in stacks.items() for frames, n in rows)


def test_profile_step_splits_each_process_over_its_phases(capsys):
    from tools import profile_step
    trainer = ["<module> (train.py:300)", "main (train.py:290)", "run_trainer (train.py:160)"]
    sync = [*trainer, "sync_weights (controller.py:400)", "send_weights (ranks.py:93)",
            "_send (ranks.py:110)", "send (weight_sync.py:200)"]
    rank = ["<module> (train.py:300)", "main (train.py:290)", "run_rollout (train.py:200)",
            "run (env_manager.py:92)"]
    gather = ["pack (weight_sync.py:160)", "iter_full_state (trainer.py:361)"]     # (the bucket's weights)
    raw = profile_raw({
        (11, "python train.py"): [(trainer + ["train_step (trainer.py:170)"], 60), (sync + gather, 10),
                                  (sync + ["broadcast (weight_sync.py:152)"], 20), (trainer, 10)],
        (12, "python train.py"): [(rank + ["rollout_once (rollout.py:302)", "generate (proxy.py:250)"], 30),
                                  (rank + ["_pull_tasks (env_manager.py:240)"], 10)],
        (13, "VLLM::EngineCore"): [(["run_busy_loop (core.py:1)", "schedule (scheduler.py:1)"], 50)]})
    counts, pids = profile_step.classify(raw)
    assert counts["trainer", "train step: forward, backward, optimizer"] == 60
    assert counts["trainer", "full weights (state_dict gather)"] == 10
    assert counts["trainer", "weight broadcast (gloo)"] == 20
    assert counts["rollout rank", "trajectories + proxy"] == 30
    assert counts["vLLM engine core", "scheduler"] == 50
    assert dict(pids) == {"trainer": {11}, "rollout rank": {12}, "vLLM engine core": {13}}
    cpu = {11: (5.0, [0]), 12: (2.0, [1]), 13: (1.0, [1])}      # pid -> (CPU seconds in the window, cores)
    profile_step.report(raw, cpu, 10.0, [{"time_step": 0.5}, {"time_step": 0.7}], 50, [])
    out = capsys.readouterr().out
    assert "profile of 2 steps (10 s, py-spy at 50 Hz; mean step 0.600 s" in out
    assert "| **trainer** (0) | **all** | **50.0%** |" in out
    assert "| trainer | weight broadcast (gloo) | 10.0% |" in out
    assert "| rollout rank | trajectories + proxy | 15.0% |" in out


def test_profile_step_rules_name_code_that_exists():
    """Each function a phase rule looks for is still defined somewhere in the job's code (this project,
    vLLM, zmq): a rule for a renamed function would leave its phase silently empty."""
    import importlib.util

    import vllm

    from tools import profile_step
    zmq_dir = Path(importlib.util.find_spec("zmq").origin).parent    # (vLLM's messaging library)
    vllm_dir = Path(vllm.__file__).parent           # (its engine core, workers, front end, the Qwen2 model)
    sources = [*ROOT.glob("*.py"), *ROOT.glob("ext/*.py"), *(vllm_dir / "v1").rglob("*.py"),
               *(vllm_dir / "distributed").rglob("*.py"), vllm_dir / "model_executor" / "models" / "qwen2.py",
               *zmq_dir.rglob("*.py")]
    defined = set()
    for path in sources:
        text = path.read_text(errors="replace")
        defined.update(re.findall(r"^\s*(?:async def|def|class) (\w+)", text, re.M))
    native = {"sched_yield"}                                    # (a C call: py-spy shows it by name)
    names = {alt for _, _, rx in profile_step.PHASES for alt in rx.split("|") if re.fullmatch(r"\w+", alt)}
    assert names and not names - defined - native, sorted(names - defined - native)


# ---------------------------------------------------------------------------------------------
# bench_rollout --before: another tree's copy of the benchmark beside this one's (here: this tree twice)


def test_bench_rollout_before_compares_two_trees(tmp_path):
    path = tmp_path / "before.json"
    out = run_tool("tools.bench_rollout", [
        "--before", str(ROOT), "--repeats", "1", "--stream-intervals", "4", "--max-concurrency", "8",
        "--median-len", "8", "--min-len", "4", "--max-len", "16", "--warmup-s", "0.3", "--seconds", "0.5",
        "--profile-s", "0.3", "--out", str(path)])
    rows = json.loads(path.read_text())
    assert [r["name"] for r in rows] == ["before: interval 1, queue calls on the loop", "now: interval 4",
                                         "now: interval 4, 4.0 ms steps"]
    for r in rows:
        [row] = r["rows"]
        assert row["samples"] > 0 and finite(row["tokens_per_s"], row["rank_cpu_ms_per_1k_tokens"]), r["name"]
    assert "| tokens/s delivered |" in out and "rank CPU per 1,000 tokens, before / now:" in out


# ---------------------------------------------------------------------------------------------
# suite_times: results/suite.md from JUnit reports


@pytest.mark.fast
def test_suite_times_tells_the_tiers_and_files_apart(tmp_path):
    """Two JUnit reports as pytest writes them (a test's markers in its properties, as tests/conftest.py
    records them): per-tier totals, per file the tests, seconds and slowest test, the fast ones counted."""
    def case(cls, name, secs, markers, extra=""):
        return (f'<testcase classname="tests.{cls}" name="{name}" time="{secs}"><properties><property '
                f'name="markers" value="{markers}"/></properties>{extra}</testcase>')
    full = tmp_path / "full.xml"
    full.write_text('<testsuites><testsuite time="100.5">'
                    + case("test_a", "test_one", 60, "engine") + case("test_a", "test_two", 0.5, "fast")
                    + case("test_b", "test_three", 30, "", '<skipped message="no GPU"/>')
                    + case("test_b", "test_four", 2, "fast", '<failure message="x"/>')
                    + "</testsuite></testsuites>")
    fast = tmp_path / "fast.xml"
    fast.write_text('<testsuites><testsuite time="3.0">' + case("test_a", "test_two", 0.4, "fast")
                    + case("test_b", "test_four", 1.9, "fast") + "</testsuite></testsuites>")
    out = tmp_path / "suite.md"
    run_tool("tools.suite_times", [str(full), str(fast), "--out", str(out), "--how", "a test"])
    md = out.read_text()
    assert "by a test." in md
    assert "| the whole suite | 4 (2 passed, 1 skipped, 1 failed) | 100 (1.7 min) |" in md
    assert "| the quick tier (`-m fast`) | 2 | 3 |" in md
    assert "| tests marked engine (real vLLM), in the whole suite | 1 | 60 |" in md
    assert "| test_a.py | 2 | 60.5 | test_one (60.0) | 1 | 0.5 |" in md
    assert "| test_b.py | 2 | 32.0 | test_three (30.0) | 1 | 2.0 |" in md
    assert md.index("test_a.py") < md.index("test_b.py")
