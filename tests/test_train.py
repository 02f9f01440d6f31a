"""train.py end to end under torchrun: real vLLM CPU engines, gloo groups, weight broadcast.

3 ranks = 1 trainer + 2 rollout, tiny model, a few small steps. Checks the promises of the system:
staleness never exceeds the async ratio, the engines hold exactly the trainer's weights after every
sync (probe logprobs within 1e-4), async ratio 0 is synchronous, and kill + --resume continues from
the checkpoint's step and version. Where vLLM is not the subject (a killed trainer rank, torchrun's
restart and the resume) the rollout ranks run the plain-torch engine (--engine torch, ext/torch_engine.py:
it starts in a second, vLLM's in 25-50 s here), which takes every sync from the same weight-sync group;
vLLM keeps one run per capability: async at ratio 2 and 0, an engine and torchrun killed, LoRA."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.jobs import job_tree, run_to_end, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--batch-groups", "4", "--group-size", "4", "--redundant", "2", "--max-concurrency", "16",
         "--timeout-s", "180", "--check-sync-every", "1"]


def torchrun(out_dir, *args, rollout_gpus: int = 2, launcher=(), train_gpus: int = 1) -> subprocess.Popen:
    cmd = torchrun_cmd("--out-dir", str(out_dir), *SMALL, *args, rollout_gpus=rollout_gpus, launcher=launcher,
                       train_gpus=train_gpus)
    log = open(Path(out_dir).with_suffix(".log"), "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})     # (as run.sh sets it)


def assert_quiet(text: str):
    """A run's output holds nothing at INFO level, no progress bars and no torchrun banner (ext/quiet.py):
    checked on the vLLM runs here (vLLM's own lines) and on tests/test_output.py's run."""
    assert not [x for x in text.splitlines() if re.search(r"\bINFO\b", x)], text[:3000]
    for noise in ("Loading weights", "Loading safetensors", "OMP_NUM_THREADS", "Failed to load weights",
                  "Triton"):
        assert noise not in text, noise


def kill_tree(pid: int):
    """SIGKILL torchrun and everything under it. torchrun starts each worker in a session of its
    own, so killing torchrun's process group alone would leave the ranks running."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def finish(p: subprocess.Popen, out_dir, timeout=420) -> list[dict]:
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        raise
    log = Path(out_dir).with_suffix(".log").read_text()
    assert rc == 0, log[-3000:]
    return rows(out_dir)


def rows(out_dir) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.engine
@pytest.mark.parametrize("async_ratio", [2, 0])
def test_async_and_sync_runs(tmp_path, async_ratio):
    """Ratio 2: 2 trainer ranks (FSDP) and 2 engines, the ipc transport (trainer rank i hands engine i
    shared-memory buckets, the CPU twin of --colocate's CUDA IPC: no file is left in /dev/shm), held-out
    evaluation. Ratio 0: the group broadcast, with env failures and hangs injected (FaultyEnv, LatencyEnv):
    every failure a rollout rank reported reached the controller, hung calls timed out, and no sample was
    trained twice. Both: every sync's probe finds the engines holding the trainer's weights, and vLLM's
    engines print nothing at INFO level (assert_quiet)."""
    out = tmp_path / f"ratio{async_ratio}"
    shm_before = set(os.listdir("/dev/shm"))
    evaluation = ["--eval-every", "2", "--eval-prompts", "8", "--eval-k", "2"] if async_ratio else []
    # the off-policy machinery along: decoupled PPO over 2 mini-batches (async), recomputed old logprobs
    # (sync, with Dr. GRPO's advantages); training samples at temperature 0.7 (beside the evaluation's
    # greedy and T = 1 ones): engine and trainer log-probs then still agree (logp_diff_on_policy, ratio 1)
    loss = (["--loss", "decoupled_ppo", "--mini-batches", "2", "--behav-weight-cap", "5"] if async_ratio else
            ["--recompute-old-logprobs", "--adv-estimator", "drgrpo"]) + ["--temperature", "0.7"]
    # A hung call counts as a timeout only once it has hung --env-step-timeout-s, and a short run can
    # end first (a CI run failed so, with 4 steps and a 2 s timeout): 6 steps, 1 s, 10% of calls hang.
    faults = ["--env-fail-rate", "0.1", "--env-hang-rate", "0.1", "--env-step-timeout-s", "1",
              "--env-latency-s", "0.01"]
    ipc = ["--weight-transport", "ipc", "--bucket-mb", "1"]
    ranks, extra, steps = (dict(train_gpus=2, rollout_gpus=2), ipc, 4) if async_ratio else (dict(), faults, 6)
    r = finish(torchrun(out, "--steps", str(steps), "--async-ratio", str(async_ratio), "--save-every", "0",
                        *evaluation, *loss, *extra, **ranks), out)
    assert [x["step"] for x in r] == list(range(1, steps + 1))
    assert [x["version"] for x in r] == [x["step"] for x in r]
    assert f"weights: {'ipc' if async_ratio else 'group'}" in Path(out).with_suffix(".log").read_text()
    assert_quiet(Path(out).with_suffix(".log").read_text())
    for x in r:
        assert x["staleness_max"] <= async_ratio
        assert x["sync_probe_max_diff"] is not None and x["sync_probe_max_diff"] < 1e-4
        assert x["num_updates"] == (2 if async_ratio else 1) and x["logp_diff_all"] >= 0
        if "logp_diff_on_policy" in x:   # samples of the trainer's own version: engine == trainer (float32)
            assert x["logp_diff_on_policy"] < 1e-4
        assert x["num_samples"] == 16 and 0.0 <= x["reward_mean"] <= 1.0
        for key in ("time_step", "time_wait_rollout", "time_train", "time_weight_sync", "samples_per_s",
                    "tokens_per_s", "rollout_utilisation", "samples_dropped_stale", "groups_filtered",
                    "staleness_mean"):
            assert key in x, key
    if async_ratio == 0:
        assert all(x["staleness_max"] == 0 for x in r)
        # all on-policy
        assert all("logp_diff_on_policy" in x and abs(x["ratio_mean"] - 1) < 1e-4 for x in r)
    else:      # held-out evaluation: version 2's round lands in a later row, the final one in the last row
        evals = [x for x in r if "eval_version" in x]
        log = Path(out).with_suffix(".log").read_text()
        assert r[-1]["eval_version"] == 4                                  # the final weights, always
        assert 2 in [x["eval_version"] for x in evals] or "evaluation of version 2" in log
        assert all(0.0 <= x["eval_greedy"] <= 1.0 and 0.0 <= x["eval_mean_at_2"] <= 1.0 for x in evals)
    assert (out / "checkpoint" / "state.json").exists()
    if async_ratio == 0:     # the injected faults, all counted
        assert all(x["samples_duplicate"] == 0 for x in r)
        stats = json.loads((out / "rollout_stats.json").read_text())
        ranks, ctrl = stats["rollout_ranks"], stats["controller"]
        failed = sum(rk["samples_failed"] for rk in ranks)
        assert failed > 0 and ctrl["failed_samples_received"] == failed
        assert sum(rk["env_timeouts"] for rk in ranks) > 0 and sum(rk["retries"] for rk in ranks) > 0
        assert sum(x["samples_failed"] for x in r) > 0
    else:                    # the ipc transport's shared memory, all unlinked

        def left():          # shared-memory files this run made (torch_<pid>_...) whose process is gone
            import psutil
            return [f for f in set(os.listdir("/dev/shm")) - shm_before
                    if f.startswith("torch_") and not psutil.pid_exists(int(f.split("_")[1]))]
        deadline = time.monotonic() + 30        # (torch_shm_manager unlinks what an exiting process left)
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left(), left()


def test_the_torch_engine_on_a_rollout_rank_takes_every_sync_from_the_group(tmp_path, tiny_model_dir):
    """--engine torch (ext/torch_engine.py): 1 trainer + 1 rollout rank whose engine is plain torch; every
    sync reaches it over the weight-sync group (trainer rank 0's gloo broadcast, received as a vLLM
    worker receives it) and every sync's probe finds it holding the trainer's weights. The weights moved:
    the checkpoint's probe logprobs are well apart from the base model's, so an engine that missed a sync
    would fail the probe."""
    out = tmp_path / "torch-engine"
    r = finish(torchrun(out, "--engine", "torch", "--steps", "4", "--lr", "2e-3", "--warmup-steps", "0",
                        "--save-every", "0", rollout_gpus=1), out)
    log = Path(out).with_suffix(".log").read_text()
    assert "weights: group" in log and "rollout ready: 1 engine" in log
    assert [x["step"] for x in r] == [1, 2, 3, 4] and [x["version"] for x in r] == [1, 2, 3, 4]
    for x in r:
        assert x["sync_probe_max_diff"] is not None and x["sync_probe_max_diff"] < 1e-4
        assert x["num_samples"] == 16 and x["staleness_max"] <= 2
    start = re.search(r"rollout ready: .* probe diff ([0-9.e+-]+)", log)
    assert start and float(start.group(1)) < 1e-4
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from buffer import PROBE_TEXT
    from trainer import token_logprobs
    base = str(tiny_model_dir)
    ids = torch.tensor([AutoTokenizer.from_pretrained(base).encode(PROBE_TEXT)])
    with torch.no_grad():
        before, after = (token_logprobs(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), ids,
                                        torch.ones_like(ids)) for d in (base, out / "checkpoint"))
    assert (after - before).abs().max().item() > 1e-3


@pytest.mark.parametrize("victims, engine", [
    pytest.param(("engine core", "engine worker"), "vllm", id="engine core then engine worker",
                 marks=pytest.mark.engine),
    pytest.param(("trainer rank",), "torch", id="trainer rank"),
    pytest.param(("torchrun",), "vllm", id="torchrun", marks=pytest.mark.engine)])
def test_killed_process_leaves_nothing_behind(tmp_path, victims, engine):
    """SIGKILL one process of a running job. An engine (core or worker) is replaced and the run goes on: the
    engine's two processes are killed one after the other in one run, the second once the first's
    replacement serves; the run finishes. Any other death ends the job. Either way, no process of the job is
    left after it (torchrun killed: vLLM's engine processes too, through their dead rank; a trainer rank
    killed: the rollout rank, on the plain-torch engine, and the queue server)."""
    import psutil
    out = tmp_path / victims[0].replace(" ", "-")
    # 30 steps of ~0.1 s: the kills land while the run is still going (with 6 they could come after the end)
    p = torchrun(out, "--steps", "30", "--save-every", "0", "--async-ratio", "1", "--engine", engine,
                 rollout_gpus=1)
    deadline = time.monotonic() + 300
    seen: dict = {}                # every process of the job, by pid; each kill's target: one started since
    for victim in victims:
        # (two steps past the previous kill: the new engine serves; its processes are the ones to kill)
        wanted = len(rows(out)) + 2
        while len(rows(out)) < wanted or not (new := [proc for pid, (role, proc) in job_tree(p.pid).items()
                                                      if role == victim and pid not in seen]):
            assert p.poll() is None, Path(out).with_suffix(".log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step in time"
            time.sleep(0.5)
        [target] = new
        seen.update(job_tree(p.pid))
        target.kill()
    try:
        while p.poll() is None:                        # collect the job's processes until it ends
            seen.update(job_tree(p.pid))
            assert time.monotonic() < deadline + 300, "the job did not end"
            time.sleep(0.5)
    finally:
        if p.poll() is None:
            kill_tree(p.pid)
    alive = [f"{role} {pid}" for pid, (role, proc) in seen.items() if proc.is_running()
             and proc.status() != psutil.STATUS_ZOMBIE]
    t = time.monotonic()
    while alive and time.monotonic() - t < 15:         # the watchers poll their parent every second
        time.sleep(0.5)
        alive = [a for a in alive if psutil.pid_exists(int(a.split()[-1]))
                 and psutil.Process(int(a.split()[-1])).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind after killing the {', '.join(victims)}: {alive}"
    if victims[0].startswith("engine"):                # contained: the run finished, each engine replaced
        assert p.returncode == 0, Path(out).with_suffix(".log").read_text()[-3000:]
        r = rows(out)
        assert [x["step"] for x in r] == list(range(1, 31))
        stats = json.loads((out / "rollout_stats.json").read_text())
        assert stats["rollout_ranks"][0]["engine_restarts"] == len(victims)
        # a new engine holds the trainer's weights (a sync its engine died in has no probe of its own:
        # when the controller's resync comes before the next sync, its probe is reported instead)
        diffs = [x["sync_probe_max_diff"] for x in r]
        assert (all(d is None or d < 1e-4 for d in diffs) and sum(d is None for d in diffs) <= len(victims)
                and diffs[-1] is not None)
    else:
        assert p.returncode != 0


def test_a_killed_rank_restarts_and_the_run_resumes_from_its_last_checkpoint(tmp_path):
    """torchrun --max-restarts + --resume auto: SIGKILL a rank after a checkpoint; no process of that attempt
    is left, and the restarted ranks resume on their own from the last checkpoint (a killed rank costs at
    most one checkpoint interval): the rows past it are trimmed, so metrics.jsonl ends with every step
    exactly once; the resumed steps continue its version, with the engines holding the trainer's weights,
    and its data position moves on. (The plain-torch engine, --engine torch: the subject is torchrun's
    restart and the resume; vLLM's processes dying with a SIGKILLed rank: the torchrun kill above.)"""
    out = tmp_path / "heal"
    # 30 steps of ~0.1 s: the kill lands while the run is still going (with 6 it could come after the end)
    p = torchrun(out, "--steps", "30", "--save-every", "2", "--async-ratio", "1", "--resume", "auto",
                 "--engine", "torch", rollout_gpus=1, launcher=("--max-restarts", "2"))
    deadline = time.monotonic() + 400
    while not (out / "checkpoint" / "state.json").exists() or len(rows(out)) < 3:
        assert p.poll() is None, Path(out).with_suffix(".log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.5)
    first = {pid: (role, proc) for pid, (role, proc) in job_tree(p.pid).items() if role != "torchrun"}
    [rollout] = [proc for role, proc in first.values() if role == "rollout rank"]
    rollout.kill()
    state = json.loads((out / "checkpoint" / "state.json").read_text())     # (at least this one was saved)
    r = finish(p, out)
    # the killed rank's job, every process of it (its engine's, the trainer's, the queue server), is gone
    alive = [f"{role} {pid}" for pid, (role, proc) in first.items()
             if proc.is_running() and proc.status() != "zombie"]
    assert not alive, f"left behind by the killed rollout rank's job: {alive}"
    assert [x["step"] for x in r] == list(range(1, 31)) and [x["version"] for x in r] == list(range(1, 31))
    log = Path(out).with_suffix(".log").read_text()
    resumed = [int(n) for n in re.findall(r"resuming at step (\d+)", log)]
    assert resumed and all(n % 2 == 0 and 2 <= n < 30 for n in resumed), resumed   # a checkpoint, not the end
    assert all(x["sync_probe_max_diff"] < 1e-4 for x in r[resumed[-1]:])
    final = json.loads((out / "checkpoint" / "state.json").read_text())
    assert final["step"] == 30 and final["data_position"] > state["data_position"]
    assert final["next_group"] > state["next_group"] > 0              # group ids (env seeds) go on


@pytest.mark.engine
def test_lora_with_tail_batching_and_the_streaming_trainer_syncs_only_the_adapter_and_resumes(tmp_path):
    """One LoRA run (1 trainer + 1 engine) with --tail-batching --stream-trainer at ratio 0, 3 steps, then
    --resume to 5. LoRA (--lora-rank): every sync's probe finds the engine equal to the trainer's base +
    adapter, by either weight transport (the first run hands it over by ipc, the resumed one broadcasts it
    over the group), the checkpoint is a PEFT adapter, and --resume starts the engine on that adapter (the
    start-up probe). Tail batching and the streaming trainer on a real engine: every step on-policy
    (staleness 0, ratio 1), short and long rounds, the long-prompt queue in the checkpoint, and the resumed
    run starts from it (a long round first when it holds a batch)."""
    out = tmp_path / "lora-tail"
    # (a large step: the adapter must move the probe's logprobs well past 1e-4 for the checks to mean much;
    # 0.24 here after 5 steps. Not larger: at 2e-2 the reward collapsed to ~0.01 and dynamic filtering then
    # resamples each ratio-0 step for seconds)
    flags = ["--lora-rank", "8", "--lr", "2e-3", "--warmup-steps", "0", "--save-every", "3",
             "--async-ratio", "0", "--tail-batching", "--stream-trainer", "--micro-batch", "4"]
    r = finish(torchrun(out, "--steps", "3", *flags, "--weight-transport", "ipc", rollout_gpus=1), out)
    assert "weights: ipc" in Path(out).with_suffix(".log").read_text()
    assert all(x["sync_probe_max_diff"] is not None and x["sync_probe_max_diff"] < 1e-4 for x in r)
    ck = out / "checkpoint"
    assert (ck / "adapter_model.safetensors").exists() and not (ck / "model.safetensors").exists()
    assert json.loads((ck / "adapter_config.json").read_text())["r"] == 8
    state = json.loads((ck / "state.json").read_text())
    assert state["step"] == 3 and "long_queue" in state["admission"]
    r = finish(torchrun(out, "--steps", "5", *flags, "--resume", rollout_gpus=1), out)
    assert "weights: group" in Path(out).with_suffix(".log").read_text()
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5] and all(x["sync_probe_max_diff"] < 1e-4 for x in r[3:])
    start = re.search(r"rollout ready: .* probe diff ([0-9.e+-]+)", Path(out).with_suffix(".log").read_text())
    assert start and float(start.group(1)) < 1e-4          # the engine serves the checkpoint's adapter
    for x in r:
        assert x["staleness_max"] == 0 and abs(x["ratio_mean"] - 1) < 1e-4 and x["num_samples"] == 16
        assert x["round"] in ("short", "long") and x["time_trainer_busy"] > 0
    assert r[3]["round"] == ("long" if len(state["admission"]["long_queue"]) >= 4 else "short")
    assert sum(x["prompts_deferred"] for x in r) > 0 and "long" in [x["round"] for x in r]
    # the adapter moves the probe far past 1e-4: an engine that ignored it would fail the checks above
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trainer import token_logprobs
    from buffer import PROBE_TEXT
    base_dir = json.loads((ck / "adapter_config.json").read_text())["base_model_name_or_path"]
    ids = torch.tensor([AutoTokenizer.from_pretrained(base_dir).encode(PROBE_TEXT)])
    with torch.no_grad():
        base = token_logprobs(AutoModelForCausalLM.from_pretrained(base_dir), ids, torch.ones_like(ids))
        tuned = token_logprobs(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), ck),
                               ids, torch.ones_like(ids))
    assert (tuned - base).abs().max().item() > 1e-3


def test_run_to_end_fails_naming_the_command_and_its_log(tmp_path):
    """The tools' one way to run a job: a failure exits with the command and the log to read. (train.py
    alone: it refuses the flag before torchrun's ranks would matter.)"""
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"my_tool: .*--no-such-flag.* failed \(exit \d+\); see .*run\.log"):
        run_to_end([sys.executable, "train.py", "--out-dir", str(out), "--no-such-flag"], out, "my_tool",
                   timeout_s=120)
    assert "--no-such-flag" in (tmp_path / "run.log").read_text()
