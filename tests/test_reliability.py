"""Bad input gets a clear answer before anything starts; nothing outlives its parent; a stalled run
says why; checkpoints fail cleanly. (No engines here: these run in seconds.)"""

import asyncio
import errno
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from buffer import LocalQueues, ManagerQueues, Sample, SampleBuffer
from controller import AsyncController, ControllerConfig

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_py(*args, env=None) -> subprocess.CompletedProcess:
    """train.py run directly (no torchrun): flags and the run directory are checked before torchrun's
    variables are even looked at."""
    return subprocess.run([PY, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)


# ---------------------------------------------------------------------------------------------
# flags


BAD_FLAGS = [
    (["--timeout-s", "0"], "--timeout-s"),
    (["--redundant", "-100"], "--redundant"),
    (["--env", "nope"], "--env"),
    (["--batch-groups", "1", "--group-size", "1"], "--group-size"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--suspend-mode", "later"], "--suspend-mode"),
    (["--resume", "--overwrite"], "--overwrite"),
    (["--check-sync-every", "-1"], "--check-sync-every"),
    (["--mini-batches", "0"], "--mini-batches"),
    (["--dual-clip", "0.5"], "--dual-clip"),
    (["--gspo-clip-low", "2"], "--gspo-clip-low"),
    (["--loss-agg", "sum"], "--loss-agg"),
    (["--sample-order", "newest"], "--sample-order"),
    (["--engine", "vulkan"], "--engine"),
    (["--engine", "torch", "--lora-rank", "8"], "--engine torch cannot run with --lora-rank"),
    (["--engine", "torch", "--colocate", "--async-ratio", "0"], "--engine torch cannot run with --colocate"),
]


@pytest.mark.parametrize("args, names", BAD_FLAGS)
def test_bad_flags_are_refused_naming_the_flag(refused, args, names):
    r, out = refused["flags", BAD_FLAGS.index((args, names))]
    assert r.returncode != 0 and names in r.stderr, r.stderr[-2000:]
    assert not out.exists()                            # refused before anything was written


# ---------------------------------------------------------------------------------------------
# the run directory: resume, overwrite


def fake_run_dir(tmp_path, step=10, rows=12, train_gpus=1, model="") -> Path:
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    config = {"train_gpus": train_gpus, "model": model}
    (out / "checkpoint" / "state.json").write_text(json.dumps({"step": step, "version": step,
                                                               "config": config}))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1, rows + 1)))
    return out


RUN_DIRS = [
    ([], "--resume to continue it, or --overwrite"),
    (["--resume", "--train-gpus", "2", "--rollout-gpus", "1"], "trainer ranks"),
    (["--resume", "--model", "/some/other/model"], "not the model this run started from"),
    (["--resume", "--steps", "10"], "nothing to do"),
]


@pytest.mark.parametrize("args, message", RUN_DIRS)
def test_run_dir_with_a_checkpoint_is_never_overwritten_by_accident(refused, args, message):
    r, (out, before) = refused["run dir", RUN_DIRS.index((args, message))]
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
    assert (out / "metrics.jsonl").read_text() == before and (out / "checkpoint" / "state.json").exists()


def test_resume_with_no_checkpoint_and_unwritable_out_dir(refused):
    r, _ = refused["resume", "no checkpoint"]
    assert r.returncode != 0 and "no checkpoint" in r.stderr
    r, _ = refused["resume", "unwritable"]
    assert r.returncode != 0 and "--out-dir" in r.stderr and "cannot be written" in r.stderr


def test_resume_trims_metrics_rows_past_the_checkpoint(tmp_path):
    from runlog import trim_metrics
    from trainer import check_run_dir
    out = fake_run_dir(tmp_path, step=10, rows=12)
    state = check_run_dir(str(out), resume="yes", overwrite=False, steps=20, train_gpus=1, model="")
    assert state["step"] == 10
    trim_metrics(str(out), state["step"])
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))


# ---------------------------------------------------------------------------------------------
# checkpoints


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['EVIL_MARKER']}",))


def test_optimizer_file_cannot_run_code_on_resume(tmp_path, monkeypatch, tiny_model_dir):
    from trainer import TrainConfig, Trainer
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARKER", str(marker))
    (tmp_path / "optimizer.rank0.pt").write_bytes(pickle.dumps({"state": _Evil()}))
    tr = Trainer(str(tiny_model_dir), TrainConfig())
    with pytest.raises(pickle.UnpicklingError):
        tr.load_optimizer(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("failure", ["enospc", "iostream"])
def test_full_disk_while_checkpointing_says_so_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch,
                                                                                 tiny_model_dir, failure):
    import shutil as shutil_mod

    import trainer as trainer_mod
    tr = trainer_mod.Trainer(str(tiny_model_dir), trainer_mod.TrainConfig())
    tr.save_checkpoint(str(tmp_path), {"step": 1, "version": 1}, str(tiny_model_dir))    # a good one first
    real_save = torch.save

    def full_disk(obj, path, *a, **kw):
        real_save(obj, path, *a, **kw)           # a partial file is left behind, as on a real full disk
        if failure == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 512 vs 0: "
                           "iostream error")
    monkeypatch.setattr(trainer_mod.torch, "save", full_disk)
    if failure == "iostream":       # the message must come from the disk's state, not from the exception text
        usage = shutil_mod.disk_usage(tmp_path)
        monkeypatch.setattr(trainer_mod.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(OSError, match="No space left on device"):
        tr.save_checkpoint(str(tmp_path), {"step": 2, "version": 2}, str(tiny_model_dir))
    assert not list(tmp_path.glob("*.tmp")) and (tmp_path / "checkpoint").is_symlink()
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text())["step"] == 1


# ---------------------------------------------------------------------------------------------
# the queue server


SERVE = """
import sys, time
sys.path.insert(0, {root!r})
from buffer import ManagerQueues
q = ManagerQueues.serve("127.0.0.1", {port}, b"k", 1)
print("serving", flush=True)
time.sleep(600)
"""


def test_queue_server_dies_with_its_parent_even_on_sigkill():
    import psutil
    port = free_port()
    p = subprocess.Popen([PY, "-c", SERVE.format(root=str(ROOT), port=port)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "serving"
    children = psutil.Process(p.pid).children(recursive=True)
    assert children, "the manager's server process"
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {alive}"
    ManagerQueues.serve("127.0.0.1", port, b"k2", 1).shutdown()       # the port is free again


def test_port_in_use_is_reported_as_such():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"port 127.0.0.1:{port} is in use"):
            ManagerQueues.serve("127.0.0.1", port, b"k", 1)


# ---------------------------------------------------------------------------------------------
# a run that cannot form a batch says why, within the timeout


def sample(gid, i, reward=1.0, failed=False, error=""):
    return Sample(f"{gid}.{i}", gid, [1], [2], [-1.0], [1], [0], reward, failed=failed,
                  meta={"error": error, "retrying": True})


@pytest.mark.parametrize("kind", ["filtered", "failed", "silent"])
def test_a_step_that_cannot_complete_fails_with_the_reason(kind):
    async def main():
        buf = SampleBuffer(LocalQueues(1), "trainer rank 0", timeout_s=0.5)
        ctrl = AsyncController(ControllerConfig(batch_groups=1, group_size=2, timeout_s=0.5), buf,
                               iter(lambda: None, 1), 1)
        ctrl.problems = iter(lambda: None, 1)

        async def feed():                      # samples keep arriving, none makes a usable group (failed
            # ones: fewer than controller.FailureBreaker's window of 64, which would end the run first)
            for g in range(25 if kind == "failed" else 10**6):
                if kind == "silent":
                    return
                for i in range(2):
                    s = sample(f"x{g}", i, failed=kind == "failed",
                               error="env 'single-turn' reset raised boom")
                    await buf.put_samples([s])
                await asyncio.sleep(0.01)
        f = asyncio.create_task(feed())
        t = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            await ctrl.collect()
        f.cancel()
        return str(e.value), time.monotonic() - t
    msg, elapsed = asyncio.run(main())
    assert "no new group became ready for 0s" in msg or "no new group became ready" in msg
    assert elapsed < 2.0
    if kind == "filtered":
        assert "groups filtered" in msg and "rewards [1.0, 1.0]" in msg
    elif kind == "failed":
        assert "reset raised boom" in msg
    else:
        assert "nothing arrived" in msg


SAVE_SERVER = """
import os, sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from trainer import Trainer, TrainConfig, read_checkpoint_state
tr = Trainer({model!r}, TrainConfig())            # imported and built once: each child is a fork of this
print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:                                  # a trainer that saves every iteration until it is killed
        st = read_checkpoint_state({out!r})
        step = st["step"] if st else 0
        print("saving", os.getpid(), flush=True)
        while True:
            step += 1
            tr.save_checkpoint({out!r}, {{"step": step, "version": step}}, {model!r})
    os.waitpid(pid, 0)
    print("killed", flush=True)
"""


def test_checkpoint_survives_sigkill_at_any_moment(tmp_path, tiny_model_dir):
    """Save every iteration, SIGKILL at random moments, 20 times: each time the latest checkpoint
    loads (state, model, optimizer) and the step never goes back. (Each saving process is a fork of one
    that imported and built the trainer once: 20 fresh interpreters spent ~2 minutes importing.)"""
    import random

    from transformers import AutoModelForCausalLM

    from trainer import TrainConfig, Trainer, read_checkpoint_state
    out, rng, last = tmp_path / "run", random.Random(0), 0
    code = SAVE_SERVER.format(root=str(ROOT), model=str(tiny_model_dir), out=str(out))
    server = subprocess.Popen([PY, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        for kill in range(20):
            server.stdin.write("go\n")
            server.stdin.flush()
            word, pid = server.stdout.readline().split()
            assert word == "saving"
            time.sleep(rng.uniform(0.05, 1.0))         # saves take ~50-150 ms: most kills land mid-save
            os.kill(int(pid), signal.SIGKILL)
            assert server.stdout.readline().strip() == "killed"
            state = read_checkpoint_state(str(out))
            if state is None:                          # killed before the first save completed
                assert last == 0
                continue
            assert state["step"] >= last
            last = state["step"]
            ck = out / "checkpoint"
            AutoModelForCausalLM.from_pretrained(ck)   # the latest checkpoint is a loadable HF model dir ...
            torch.load(ck / "optimizer.rank0.pt", weights_only=True)   # ... with its optimizer state
    finally:
        server.stdin.close()
        server.wait(30)
    assert last >= 10
    Trainer(str(ck), TrainConfig()).load_optimizer(ck)


def model_dir_variant(tmp_path, tiny_model_dir, what: str) -> Path:
    import shutil
    d = tmp_path / f"model-{what}"
    if what == "missing":
        return d
    shutil.copytree(tiny_model_dir, d)
    if what == "no-config":
        (d / "config.json").unlink()
    elif what == "corrupt-config":
        (d / "config.json").write_text('{"model_type": "qwen2", ')
    elif what == "no-weights":
        for f in d.glob("*.safetensors"):
            f.unlink()
    elif what == "corrupt-tokenizer":
        (d / "tokenizer.json").write_text("not json")
    return d


BAD_MODELS = [
    ("missing", "no such directory"), ("no-config", "no config.json"), ("corrupt-config", "not valid JSON"),
    ("no-weights", "no weights"), ("corrupt-tokenizer", "tokenizer does not load"),
]


@pytest.mark.parametrize("what, message", BAD_MODELS)
def test_bad_model_dir_is_named_before_anything_starts(refused, what, message):
    r, model = refused["model", BAD_MODELS.index((what, message))]
    assert r.returncode != 0 and f"--model {model}" in r.stderr and message in r.stderr, r.stderr[-2000:]


BAD_DATA = [
    (None, "no such file"), ("DIR", "directory"), ("", "no rows"),
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": oops}\n', "line 2"),
    ('{"question": "1+1"}\n', "line 1"),
]


@pytest.mark.parametrize("content, message", BAD_DATA)
def test_bad_data_is_named_before_anything_starts(refused, content, message):
    r, _ = refused["data", BAD_DATA.index((content, message))]
    assert r.returncode != 0 and "--data" in r.stderr and message in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# train.py without torchrun: the one-process run's refusal, --help, --dry-run


def test_without_torchrun_train_py_names_torchrun_and_help_lists_the_flags(refused):
    """Two rollout ranks need torchrun (the one-process run says so); an unknown loss is refused naming its
    flag; --help lists the main flags."""
    r, _ = refused["train", "no torchrun"]
    assert r.returncode != 0 and "torchrun" in r.stderr
    r, out = refused["train", "bad loss"]
    assert r.returncode != 0 and "--loss" in r.stderr and not out.exists()
    h, _ = refused["train", "help"]
    for flag in ("--rollout-gpus", "--train-gpus", "--async-ratio", "--loss", "--steps", "--out-dir",
                 "--model", "--data", "--resume", "--engine"):
        assert flag in h.stdout


QWEN_7B = ROOT / "tools" / "qwen2.5-7b"          # Qwen2.5-7B's public config.json, no weights
DRY_RUNS_BAD = [(["--dry-run", "--model", str(ROOT / "nowhere")], "--model"),
                (["--dry-run", "tpu"], "--dry-run")]


def test_dry_run_prints_the_plan_without_torchrun(refused):
    """train.py --dry-run (ext/memplan.py): no torchrun environment, no engine, no process group: the plan
    and exit 0 (the Qwen2.5-7B config at the README's 24 + 16 layout; and the embedded model, which need not
    be built); a bad --model or --dry-run value is refused naming its flag."""
    r, _ = refused["dry run", "qwen 7b"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert "7,615.6M params" in r.stdout and "per trainer rank (16, bf16" in r.stdout
    assert "per engine (24, bfloat16)" in r.stdout and "RANK" not in r.stdout + r.stderr
    r, _ = refused["dry run", "embedded"]
    assert r.returncode == 0 and "the embedded model 1.1M params" in r.stdout, r.stderr[-2000:]
    for i, (_, flag) in enumerate(DRY_RUNS_BAD):
        r, _ = refused["dry run", i]
        assert r.returncode != 0 and flag in r.stderr


# ---------------------------------------------------------------------------------------------
# the refusals above, run at once


@pytest.fixture(scope="module")
def refused(tmp_path_factory, tiny_model_dir) -> dict:
    """Every train.py run of the tests above (bad flags, a run dir with a checkpoint, resume without one, an
    unwritable --out-dir, bad model dirs, bad data, no torchrun, --help, --dry-run), each set up in a dir of
    its own and run here, two at a time (each is one process that imports torch and stops at its check: ~2 s
    of one core). (kind, case) -> (CompletedProcess, what the test checks besides: the out dir, the run dir
    and its metrics.jsonl before, the model dir)."""
    import concurrent.futures
    base = tmp_path_factory.mktemp("refused")
    cases = {}                                   # (kind, case) -> (train.py's args, the context)

    def new(name: str) -> Path:
        (base / name).mkdir()
        return base / name
    for i, (args, _) in enumerate(BAD_FLAGS):
        out = new(f"flags{i}") / "out"
        cases["flags", i] = ["--out-dir", str(out), *args], out
    for i, (args, _) in enumerate(RUN_DIRS):
        out = fake_run_dir(new(f"run-dir{i}"))
        cases["run dir", i] = ["--out-dir", str(out), *args], (out, (out / "metrics.jsonl").read_text())
    cases["resume", "no checkpoint"] = ["--out-dir", str(new("resume") / "empty"), "--resume"], None
    blocker = new("unwritable") / "file"
    blocker.write_text("not a dir")
    cases["resume", "unwritable"] = ["--out-dir", str(blocker / "sub")], None
    for i, (what, _) in enumerate(BAD_MODELS):
        d = new(f"model{i}")
        model = model_dir_variant(d, tiny_model_dir, what)
        cases["model", i] = ["--out-dir", str(d / "out"), "--model", str(model)], model
    for i, (content, _) in enumerate(BAD_DATA):
        d = new(f"data{i}")
        data = d / "data.jsonl"
        if content == "DIR":
            data.mkdir()
        elif content is not None:
            data.write_text(content)
        cases["data", i] = ["--out-dir", str(d / "out"), "--data", str(data)], None
    cases["train", "no torchrun"] = ["--rollout-gpus", "2", "--train-gpus", "1", "--out-dir",
                                     str(new("no-torchrun") / "out")], None
    out = new("bad-loss") / "out"
    cases["train", "bad loss"] = ["--out-dir", str(out), "--loss", "nope"], out
    cases["train", "help"] = ["--help"], None
    cases["dry run", "qwen 7b"] = ["--dry-run", "gpu", "--model", str(QWEN_7B), "--rollout-gpus", "24",
                                   "--train-gpus", "16", "--max-tokens-per-micro", "16384"], None
    cases["dry run", "embedded"] = ["--dry-run", "cpu"], None
    for i, (args, _) in enumerate(DRY_RUNS_BAD):
        cases["dry run", i] = args, None
    # none of torchrun's variables, whatever this process has: train.py as typed on a command line
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {key: pool.submit(train_py, *args, env=env) for key, (args, _) in cases.items()}
    return {key: (runs[key].result(), context) for key, (_, context) in cases.items()}
