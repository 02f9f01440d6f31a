"""The cited tools that launch `torchrun train.py` jobs (soak, bench_e2e, bench_agent train, bench_lora,
bench_weight_sync, tail_learning), each run as its command runs (tests/toolrun.py) at tiny settings.

One real job for the module: soak's (the default layout with injected env failures and hangs, evaluation
every 5 steps, a final checkpoint), run by tools.soak itself. Every other tool's jobs go through
tools.jobs.run_to_end, which here parses the job's command with train.py's own parser (a flag it no longer
has, or a layout torchrun would not give it, fails the test) and answers with that real run's files
(metrics.jsonl, rollout_stats.json, checkpoint/): what the tools read back is what train.py writes today.
The baselines that run in this process (bench_e2e's naive and lockstep loops) run for real."""

import contextlib
import inspect
import io
import json
import shutil
from pathlib import Path

import pytest

from toolrun import finite, last_json, run_tool

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent
TINY_JOB = "--batch-groups 2 --group-size 4 --max-tokens 4 --max-concurrency 8".split()


@pytest.fixture(scope="module")
def soak_run(tmp_path_factory, tiny_model_dir):
    """(the run's out_dir, soak's JSON): `python -m tools.soak` on a 10-step job."""
    out = tmp_path_factory.mktemp("soak") / "run"
    text = run_tool("tools.soak", [*"--minutes 5 --every-s 2 --warmup-min 0 --out-dir".split(), str(out),
                                   "--", *"--steps 10 --eval-every 5 --eval-prompts 4".split(), *TINY_JOB])
    return out, last_json(text)


@pytest.fixture(autouse=True)
def torch_threads():
    """bench_e2e's baselines run torch on every core (as the command does): this process's setting back
    after each test."""
    import torch
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def train_config(cmd: list[str]):
    """train.py's Config for `torchrun ... train.py ARGS`, by train.py's own parser; the layout checked
    against torchrun's --nproc-per-node."""
    from config import parse_cli
    import train
    assert Path(cmd[0]).name == "torchrun" and "train.py" in cmd, cmd
    argv, err = cmd[cmd.index("train.py") + 1:], io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = parse_cli(train.Config, argv)
    except SystemExit:
        pytest.fail(f"train.py refuses {' '.join(argv)}:\n{err.getvalue()}")
    assert cfg.rollout_gpus + cfg.train_gpus == int(cmd[cmd.index("--nproc-per-node") + 1])
    return cfg


def lora_checkpoint(ckpt: Path, cfg, model_dir: str):
    """A LoRA run's checkpoint weights, as ext/lora.py writes them (its Weights' save): the adapter alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from ext.lora import lora_weights
    weights = lora_weights(cfg.ext["lora"])
    model = weights.wrap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    (ckpt / "model.safetensors").unlink()
    weights.save(ckpt, weights.named(model, tied=True), model, model_dir)


@pytest.fixture
def jobs(soak_run, monkeypatch, tiny_model_dir):
    """tools.jobs.run_to_end answers every train.py job with the real run's files; returns each job's
    (who, Config) as the tools launched them."""
    import tools.jobs
    run_dir, launched = soak_run[0], []

    real = inspect.signature(tools.jobs.run_to_end)

    def run_to_end(*args, **kwargs):
        call = real.bind(*args, **kwargs)            # (as the real one would take it)
        call.apply_defaults()
        cmd, out, who, cwd = (call.arguments[k] for k in ("cmd", "out", "who", "cwd"))
        cfg = train_config(cmd)
        assert Path(cwd, cfg.out_dir).resolve() == Path(cwd, out).resolve(), (cfg.out_dir, out)
        shutil.copytree(run_dir, out, dirs_exist_ok=True)
        if cfg.ext["lora"].lora_rank:
            lora_checkpoint(Path(out) / "checkpoint", cfg, str(tiny_model_dir))
        launched.append((who, cfg))
        return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]

    monkeypatch.setattr(tools.jobs, "run_to_end", run_to_end)
    return launched


def test_soak_watches_a_faulty_run_and_finds_no_leak(soak_run):
    run_dir, res = soak_run
    assert res["exit_status"] == 0 and res["steps"] == 10
    # (evaluation's failed samples too: the controller counts those its taps take)
    assert res["staleness_bound_held_every_step"] and res["samples_failed"] > 0
    assert res["failures_counted_both_sides"]
    end = res["at_end"]
    assert end["engine_requests_in_flight"] == [0] and end["env_manager_slots_in_use"] == [0]
    assert 0 <= end["groups_unresolved"] <= end["admission_bound"] == 3 * 2 + 4   # (ratio + 1) B + redundant
    assert {"trainer rank", "rollout rank", "engine core"} <= set(res["memory"])
    for role, m in res["memory"].items():
        assert finite(m["rss_mb_first"], m["rss_mb_last"], m["rss_slope_mb_per_10min"]), role
        assert m["rss_mb_first"] > 0, role
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # (tail_learning reads them) version 5's round lands in a later row, or, when it ends during the last
    # step, in the log only: that row carries the final weights' round
    evals = [r["eval_version"] for r in rows if "eval_greedy" in r]
    log = run_dir.with_suffix(".log").read_text()
    assert evals == [5, 10] or (evals == [10] and "evaluation of version 5" in log), evals


def test_bench_e2e_naive_sync_and_async(jobs, tmp_path):
    out = run_tool("tools.bench_e2e", [*"--seeds 0 --steps 10 --naive-steps 10 --target 0 --batch-groups 2 "
                                       "--group-size 2 --micro-batch 8".split(), "--out-dir", str(tmp_path)])
    res = last_json(out)
    assert [cfg.controller.async_ratio for _, cfg in jobs] == [0, 2]
    assert {(c.controller.batch_groups, c.controller.group_size, c.steps) for _, c in jobs} == {(2, 2, 10)}
    assert set(res["runs"]) == {"naive", "sync", "async"}
    for name, [r] in res["runs"].items():
        assert r["steps"] == 10 and r["steps_to_target"] == 10, name
        assert finite(r["s_per_step"], r["seconds_to_target"], r["wall_s"], r["reward_first10"]), name
    # the naive baseline trained for real (transformers' generate, then Trainer.train_step; its reply budget
    # resolved as train.py resolves it: RolloutConfig.resolved's signature once changed under it)
    [naive] = res["runs"]["naive"]
    assert all(isinstance(naive[k], float)
               for k in ("s_per_step", "wall_s", "reward_first10", "reward_last10"))
    assert finite(naive["reward_last10"]) and naive["s_per_step"] > 0 and 0 <= naive["reward_first10"] <= 1
    # (naive_over_async_wall is left out: the system's jobs here take no time)
    ratios = {k: v for k, v in res["ratios"].items() if not k.endswith("_wall")}
    assert len(ratios) == 3 and all(finite(v) for v in ratios.values()), res["ratios"]


def test_bench_e2e_agentic_lockstep_and_system(jobs, tmp_path, monkeypatch, tiny_model_dir):
    import ext.calc
    # the lockstep loop on the tiny model: the calc model's warm start takes many minutes here, and what
    # is tested is the loop (the calculator env, its sandbox and latency, the trainer), not the model
    monkeypatch.setattr(ext.calc, "ensure_calc_model", lambda log=print: tiny_model_dir)
    out = run_tool("tools.bench_e2e", [*"--env calc --env-latency-s 0.01 --env-latency-sigma 0.5 --seeds 0 "
                                       "--steps 2 --naive-steps 2 --batch-groups 2 --group-size 2 "
                                       "--max-concurrency 4".split(), "--out-dir", str(tmp_path)])
    res = last_json(out)
    ctrl = [cfg.controller for _, cfg in jobs]
    assert [(c.env, c.async_ratio, c.env_redundancy) for c in ctrl] == [("calc", 0, 0), ("calc", 2, 0),
                                                                        ("calc", 2, 2)]
    assert set(res["runs"]) == {"lockstep", "sync", "async", "redundant"}
    [lock] = res["runs"]["lockstep"]
    assert lock["steps"] == 2 and finite(lock["s_per_step"], lock["turns_mean"]) and lock["turns_mean"] >= 1
    # the lockstep baseline trained for real over the calculator env (its sandbox, injected latency,
    # deadlines), on the tiny model; 2 steps reach no target (its window is 10)
    assert lock["steps_to_target"] is None and lock["seconds_to_target"] is None
    assert all(isinstance(lock[k], float) and finite(lock[k])
               for k in ("s_per_step", "wall_s", "reward_first10", "reward_last10"))
    assert lock["s_per_step"] > 0 and 0 <= lock["reward_first10"] <= 1 and lock["samples_dropped_failed"] >= 0
    for name in ("sync", "async", "redundant"):
        [r] = res["runs"][name]
        assert finite(r["s_per_step"], r["turns_mean"], r["samples_failed"], r["samples_surplus"]), name
    ratios = res["ratios"]
    assert finite(ratios["async_over_redundant_s_per_step"], ratios["async_over_sync_s_per_step"])


def test_bench_e2e_rollpacker_runs_its_five(jobs, tmp_path):
    out = run_tool("tools.bench_e2e", ["--rollpacker", "--steps", "3", "--target", "0.44", "--seeds", "0",
                                       "--out-dir", str(tmp_path)])
    res = last_json(out)
    assert [(cfg.controller.async_ratio, cfg.ext["tail_batching"].tail_batching,
             cfg.ext["stream_trainer"].stream_trainer, cfg.ext["longtail"].response_len_median)
            for _, cfg in jobs] == [(0, False, False, 8.0), (0, True, False, 8.0), (0, True, True, 8.0),
                                    (2, False, False, 8.0), (2, True, False, 8.0)]
    assert set(res["runs"]) == {"sync", "sync_tail", "sync_tail_stream", "async", "async_tail"}
    assert all(finite(r["s_per_step"], r["aborted_share"], r["trainer_busy"]) for [r] in res["runs"].values())
    assert all(finite(v) for k, v in res["ratios"].items() if k.endswith("s_per_step"))


def test_bench_agent_train_runs_the_env_and_the_agent(jobs, tmp_path, monkeypatch, tiny_model_dir):
    import ext.calc
    monkeypatch.setattr(ext.calc, "ensure_calc_model", lambda log=print: tiny_model_dir)   # (as above)
    out = run_tool("tools.bench_agent", [*"train --seeds 0 --steps 10 --window 2 --batch-groups 2 "
                                         "--group-size 4".split(), "--out-dir", str(tmp_path)])
    res = last_json(out)
    env, agent = (cfg for _, cfg in jobs)
    assert (env.controller.env, env.ext["agent"].agent) == ("calc", "")
    assert agent.ext["agent"].agent == "examples/calc_agent.py:agent" and agent.model == str(tiny_model_dir)
    for kind in ("env", "agent"):
        [r] = res["runs"][kind]
        assert finite(r["first"], r["last"], r["s_per_step"]), kind
    assert isinstance(res["agent_within_env_spread"], bool)


def test_bench_lora_compares_full_and_lora_runs(jobs, tmp_path):
    out = run_tool("tools.bench_lora", ["--models", "tiny", "--ranks", "0", "8", "--steps-tiny", "10",
                                        "--out-dir", str(tmp_path)])
    res = last_json(out)
    assert [cfg.ext["lora"].lora_rank for _, cfg in jobs] == [0, 8]
    assert "| tiny | full |" in out and "| tiny | LoRA rank 8 |" in out
    full, lora = res["results"]
    for r in (full, lora):
        assert finite(r["sync_mb"], r["s_per_sync"], r["optimizer_mb"], r["peak_gb"], r["s_per_step"]), r
    ratios = res["ratios"]["tiny r8"]
    assert ratios["sync_bytes_full_over_lora"] > 1 and all(finite(v) for v in ratios.values())


def test_bench_weight_sync_transports_and_before(jobs, tmp_path, tiny_model_dir):
    # the 103M run's flags on the tiny model (--model-103m): what is checked is the command, not the model
    out = run_tool("tools.bench_weight_sync", ["--transports", "--model-103m", str(tiny_model_dir),
                                               "--steps", "10", "--default-steps", "10",
                                               "--out-dir", str(tmp_path / "t")])
    res = last_json(out)
    assert [(cfg.weight_transport, cfg.model) for _, cfg in jobs] == [
        ("group", str(tiny_model_dir)), ("ipc", str(tiny_model_dir)), ("group", ""), ("ipc", "")]
    assert [(r["run"], r["tree"]) for r in res["results"]] == [("103M", "group"), ("103M", "ipc"),
                                                               ("default", "group"), ("default", "ipc")]
    for r in res["results"]:
        assert finite(r["s_per_sync"], r["gb_per_s"], r["first_sync_s"], r["vllm_load_s"], r["sync_share"],
                      r["util"]), r
    assert all(finite(v["group_over_ipc_s_per_sync"]) for v in res["ratios"].values())
    # --before: this tree stands in for the old one (the command's path; both report as "after")
    jobs.clear()
    out = run_tool("tools.bench_weight_sync", ["--before", str(ROOT), "--runs", "default", "--default-steps",
                                               "10", "--out-dir", str(tmp_path / "b")])
    res = last_json(out)
    assert len(jobs) == 2 and finite(res["ratios"]["default"]["speedup_s_per_sync"])


def test_tail_learning_writes_its_table_and_plot(jobs, tmp_path):
    run_tool("tools.tail_learning", ["--seeds", "0", "--steps", "10", "--eval-every", "5",
                                     "--out-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path)])
    assert [(cfg.ext["tail_batching"].tail_batching, cfg.controller.async_ratio, cfg.ext["eval"].eval_every)
            for _, cfg in jobs] == [(False, 0, 5), (True, 0, 5)]
    table = (tmp_path / "tail_learning.md").read_text()
    assert "| off | 0 |" in table and "| tail batching | 0 |" in table
    assert (tmp_path / "tail_learning.png").read_bytes().startswith(b"\x89PNG")
