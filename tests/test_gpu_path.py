"""The GPU path, as far as a CPU machine can check it: which device each engine and thread uses,
and the colocated mode's control flow (fake engine). Tests marked `gpu` need CUDA and are skipped
without it (none has run here: this machine has no GPU)."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from buffer import Cmd, Command, LocalQueues, Phase, SampleBuffer
from conftest import run_virtual
from controller import AsyncController, ControllerConfig
from env_manager import EnvManager, RolloutConfig
from tools.fake_engine import FakeTimedEngine
from proxy import LLMProxy, Status
from task import Problem
from proxy import cpu_layout, engine_gpu

ROOT = Path(__file__).resolve().parent.parent
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_each_engine_gets_its_ranks_own_gpu():
    # 8 GPUs, one process each: rollout ranks with LOCAL_RANK 3..7 get GPUs 3..7 (not all GPU 0)
    assert [engine_gpu(r, None, 8) for r in range(3, 8)] == ["3", "4", "5", "6", "7"]
    # --colocate on 4 GPUs (8 processes): rollout rank with LOCAL_RANK 4 + i shares trainer rank i's GPU
    assert [engine_gpu(r, None, 4) for r in range(4, 8)] == ["0", "1", "2", "3"]
    # a user's CUDA_VISIBLE_DEVICES is a list of names, honoured as such
    assert [engine_gpu(r, "4,5, 6,7", 4) for r in (0, 2, 5)] == ["4", "6", "5"]


def test_cpu_layout_gives_each_engine_a_core_of_its_own():
    """CPU runs: engines take cores from the top, one each; the ranks' own Python shares the rest;
    with no core to spare, everything shares every core."""
    assert cpu_layout([0, 1], 1) == ([0], [1])             # this machine's default: 1 trainer + 1 engine
    assert cpu_layout(list(range(8)), 3) == ([0, 1, 2, 3, 4], [5, 6, 7])
    assert cpu_layout([0, 1], 2) == ([0, 1], [0, 1])                 # 2 engines on 2 cores: no core to spare


def test_colocated_sleep_then_sync_wakes_loads_and_resumes(tok):
    """--colocate's control flow on the fake engine: after collect, SLEEP ends the work and puts the
    engine to sleep (ack SLEPT); the SYNC that follows the training step wakes it before the load
    (the fake engine, like vLLM, refuses a load while asleep), then rollout goes on."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        proxy = LLMProxy(FakeTimedEngine(t0=0.1, k=0.0, length_sampler=lambda rng: 5), rank=0, timeout_s=30)
        m = EnvManager(proxy, buf, tok, 0, RolloutConfig(max_tokens=8, max_model_len=2000), async_ratio=0)
        ctrl = AsyncController(ControllerConfig(batch_groups=2, group_size=2, async_ratio=0,
                                                redundant=0, filter_groups=False),
                               buf, iter(lambda: Problem("1+1=", "2"), None), 1)
        run = asyncio.create_task(m.run())
        await ctrl.wait_ready()
        seen = []
        for step in range(2):
            batch, _ = await ctrl.collect()
            await ctrl.sleep_engines()
            seen.append((proxy.asleep, proxy.engine.asleep, proxy.status, len(batch)))
            await ctrl.sync_weights(ctrl.version + 1, send_fn=lambda group: None)
        await ctrl.finish_sync()
        after = (proxy.asleep, proxy.status, proxy.engine.num_loads, proxy.version)
        await ctrl.stop()
        stats = await run
        return seen, after, stats
    seen, after, stats = run_virtual(main())
    assert seen == [(True, True, Status.SUSPENDED, 4)] * 2
    assert after == (False, Status.RUNNING, 2, 2)
    assert stats["samples_sent"] >= 8


@pytest.fixture(scope="module")
def tok():
    from tiny_model import build_tokenizer
    return build_tokenizer()


def test_colocate_needs_ratio_0_and_equal_gpus(tmp_path):
    for args in (["--colocate", "--async-ratio", "2"],
                 ["--colocate", "--async-ratio", "0", "--rollout-gpus", "2"]):
        r = subprocess.run([sys.executable, "train.py", "--out-dir", str(tmp_path / "o"), *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "--colocate" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_colocate_is_refused_without_gpus(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tools.jobs import free_port_pair
    r = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2",
                        "--master-port", str(free_port_pair()), "train.py", "--colocate",
                        "--async-ratio", "0", "--out-dir", str(tmp_path / "o")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--colocate needs GPUs" in r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# on a GPU machine (not run here)


def torchrun(tmp_path, nproc, *args):
    sys.path.insert(0, str(Path(__file__).parent))
    from tools.jobs import free_port_pair
    out = tmp_path / "run"
    r = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(nproc),
                        "--master-port", str(free_port_pair()), "train.py", "--out-dir", str(out),
                        "--steps", "3", "--batch-groups", "4", "--group-size", "4", "--check-sync-every", "1",
                        "--timeout-s", "300", "--save-every", "0", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@gpu
def test_gpu_one_trainer_one_engine_probe_after_every_sync(tmp_path):
    # float32 on both sides (--precision's GPU default is bf16): the engine holds the trainer's weights
    rows = torchrun(tmp_path, 2, "--rollout-gpus", "1", "--train-gpus", "1", "--dtype", "float32",
                    "--precision", "fp32")
    assert all(r["sync_probe_max_diff"] < 1e-3 for r in rows)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_gpu_two_engines_on_two_devices_and_fsdp_over_two_trainer_ranks(tmp_path):
    # 12 samples: uneven shards
    from runlog import PROBE_TOLERANCE
    rows = torchrun(tmp_path, 4, "--rollout-gpus", "2", "--train-gpus", "2", "--batch-groups", "3")
    # bf16 engines and a bf16 trainer (sharded start, mixed precision): bf16's tolerance
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync_probe_max_diff"] < PROBE_TOLERANCE["bf16"] for r in rows)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_colocated_sync_baseline(tmp_path):
    rows = torchrun(tmp_path, 4, "--rollout-gpus", "2", "--train-gpus", "2", "--colocate",
                    "--async-ratio", "0")
    assert all(r["staleness_max"] == 0 for r in rows)
