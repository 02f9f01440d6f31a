"""The GPU path, as far as a CPU machine can check it: which device each engine and thread uses,
and the colocated mode's control flow (fake engine). Tests marked `gpu` need the GPUs their torchrun layout
takes and are skipped without them (none has run here: this machine has no GPU)."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from buffer import Cmd, Command, LocalQueues, Phase, SampleBuffer
from conftest import run_virtual
from controller import AsyncController, ControllerConfig
from ext.colocate import sleep_engines
from env_manager import EnvManager, RolloutConfig
from tools.fake_engine import FakeTimedEngine
from proxy import LLMProxy, Status
from task import Problem
from ranks import cpu_layout, engine_gpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.fast
def test_each_engine_gets_its_ranks_own_gpu():
    # 8 GPUs, one process each: rollout ranks with LOCAL_RANK 3..7 get GPUs 3..7 (not all GPU 0)
    assert [engine_gpu(r, None, 8) for r in range(3, 8)] == ["3", "4", "5", "6", "7"]
    # --colocate on 4 GPUs (8 processes): rollout rank with LOCAL_RANK 4 + i shares trainer rank i's GPU
    assert [engine_gpu(r, None, 4) for r in range(4, 8)] == ["0", "1", "2", "3"]
    # a user's CUDA_VISIBLE_DEVICES is a list of names, honoured as such
    assert [engine_gpu(r, "4,5, 6,7", 4) for r in (0, 2, 5)] == ["4", "6", "5"]


@pytest.mark.fast
def test_the_layout_check_refuses_an_nccl_group_with_two_ranks_of_one_gpu():
    """Fake layouts (no GPU needed): torchrun's environment alone says which GPU each rank takes; a
    group NCCL would refuse ("Duplicate GPU detected") is named with its two ranks and their GPU,
    before any group forms."""
    from ranks import layout_errors, rank_places
    # --colocate on one node of 4 GPUs: 8 ranks, rollout rank i on trainer rank i's GPU
    colocated = rank_places(8, 8, None, 4)
    assert colocated[5] == colocated[1] == (0, "1")
    assert layout_errors(colocated, 4, "ipc", cuda=True) == []
    # the same layout with the group broadcast: trainer rank 0 and rollout rank 0's engine on GPU 0
    [err] = layout_errors(colocated, 4, "group", cuda=True)
    assert err.startswith("the weight-sync group would hold trainer rank 0 and rollout rank 0 (global rank "
                          "4), both on node 0's GPU 0: NCCL refuses")
    # --colocate over 2 nodes of 4 GPUs (8 ranks a node): trainer ranks 0..7 fill node 0, two per GPU
    errors = layout_errors(rank_places(16, 8, None, 4), 8, "ipc", cuda=True)
    assert "the trainer group (FSDP) would hold trainer rank 0 and trainer rank 4, both on node 0's GPU 0" \
        in errors[0]
    assert any("pairs trainer rank 0 (node 0's GPU 0) with rollout rank 0 (global rank 8) (node 1's GPU 0)"
               in e for e in errors)
    # one GPU per rank (the README's 24 + 16 on 5 nodes of 8): nothing to refuse, either transport's groups
    assert layout_errors(rank_places(40, 8, None, 8), 16, "group", cuda=True) == []
    # ipc without --colocate on GPUs: the pair sits on two GPUs, which CUDA IPC cannot join
    assert "CUDA IPC needs both on one GPU" in layout_errors(rank_places(4, 4, None, 4), 2, "ipc", True)[0]
    # a user's CUDA_VISIBLE_DEVICES: names as given; 3 ranks on "6,7": global ranks 0 and 2 on GPU 6
    assert "both on node 0's GPU 6" in layout_errors(rank_places(3, 3, "6,7", 2), 2, "group", cuda=True)[0]
    # CPU: gloo groups hold anything; the ipc pairs must share a node (shared memory)
    assert layout_errors(rank_places(4, 4, None, 1), 2, "ipc", cuda=False) == []
    errors = layout_errors(rank_places(4, 2, None, 1), 2, "ipc", cuda=False)   # 2 nodes: trainers on node 0
    assert len(errors) == 2 and ("trainer rank 1 (node 0) with rollout rank 1 (global rank 3) (node 1): "
                                 "shared memory needs both on one node") in errors[1]


@pytest.mark.fast
def test_weight_transport_flags(capsys):
    """--weight-transport: group by default, ipc under --colocate (auto); the contradictions named."""
    from config import parse_cli
    from train import Config
    assert parse_cli(Config, []).weight_transport == "group"
    assert parse_cli(Config, ["--colocate", "--async-ratio", "0"]).weight_transport == "ipc"
    for args, message in ((["--colocate", "--async-ratio", "0", "--weight-transport", "group"],
                           "--colocate --weight-transport group: NCCL refuses"),
                          (["--weight-transport", "ipc", "--rollout-gpus", "2"],
                           "--weight-transport ipc: .* needs --rollout-gpus == --train-gpus"),
                          (["--weight-transport", "nccl"],
                           "--weight-transport must be one of auto, group, ipc, inprocess")):
        with pytest.raises(SystemExit):
            parse_cli(Config, args)
        assert re.search(message, capsys.readouterr().err), args


@pytest.mark.fast
def test_colocated_engine_share_leaves_the_trainer_its_headroom():
    """--colocate's default --gpu-memory-utilization: free memory at the engine's start less what the
    trainer adds while the engine is awake; too little left is an error naming the flag."""
    from ext.memplan import GiB, colocated_headroom, colocated_share
    trainer = {"weights (fp32 masters)": 4 * GiB, "gradients": 4 * GiB, "AdamW moments": 8 * GiB,
               "gathered weights": 1 * GiB, "activations": 30 * GiB, "logits chunk": 2 * GiB}
    headroom = colocated_headroom(trainer, 64 << 20)
    assert headroom == (4 + 8 + 1 + 2) * GiB + 128 * 2**20          # not the activations: the engine sleeps
    share = colocated_share(80 * GiB, 75 * GiB, headroom, 14 * GiB)
    assert share == round((75 * GiB - headroom) / (80 * GiB), 3)
    assert colocated_share(80 * GiB, 80 * GiB, 0, 14 * GiB) == 0.9                # capped
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        colocated_share(80 * GiB, 30 * GiB, headroom, 14 * GiB)


@pytest.mark.fast
def test_cpu_layout_gives_each_engine_a_core_of_its_own():
    """CPU runs: engines take cores from the top, one each; the ranks' own Python shares the rest;
    with no core to spare, everything shares every core."""
    assert cpu_layout([0, 1], 1) == ([0], [1])             # this machine's default: 1 trainer + 1 engine
    assert cpu_layout(list(range(8)), 3) == ([0, 1, 2, 3, 4], [5, 6, 7])
    assert cpu_layout([0, 1], 2) == ([0, 1], [0, 1])                 # 2 engines on 2 cores: no core to spare


@pytest.mark.fast
def test_colocated_sleep_then_sync_wakes_loads_and_resumes(tok):
    """--colocate's control flow on the fake engine: after collect, SLEEP ends the work and puts the
    engine to sleep (ack SLEPT); the SYNC that follows the training step wakes it before the load
    (the fake engine, like vLLM, refuses a load while asleep), then rollout goes on."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "test")
        proxy = LLMProxy(FakeTimedEngine(t0=0.1, k=0.0, length_sampler=lambda rng: 5), rank=0, timeout_s=30)
        m = EnvManager(proxy, buf, tok, 0, RolloutConfig(max_tokens=8, max_model_len=2000), freshness=0)
        ctrl = AsyncController(ControllerConfig(batch_groups=2, group_size=2, async_ratio=0,
                                                redundant=0, filter_groups=False),
                               buf, iter(lambda: Problem("1+1=", "2"), None), 1)
        run = asyncio.create_task(m.run())
        await ctrl.wait_ready()
        seen = []
        for step in range(2):
            batch, _ = await ctrl.collect()
            await sleep_engines(ctrl)
            seen.append((proxy.asleep, proxy.engine.asleep, proxy.status, len(batch)))
            await ctrl.sync_weights(ctrl.version + 1, send_fn=lambda spec: None)
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


def gpus_needed(ranks: int, train: int, transport: str) -> int:
    """The fewest GPUs of one node on which train.py's own layout check accepts `ranks` ranks, `train` of
    them trainers (one GPU a rank; --colocate's ipc pairs share one): a run is skipped, not refused, below
    it."""
    from ranks import layout_errors, rank_places
    return next(n for n in range(1, ranks + 1)
                if not layout_errors(rank_places(ranks, ranks, None, n), train, transport, cuda=True))


def gpu_run(ranks: int, train: int, transport: str = "group"):
    """A GPU test's torchrun layout (its `layout`): skipped unless CUDA has the GPUs it needs."""
    need = gpus_needed(ranks, train, transport)

    def mark(test):
        test.layout = (ranks, train, transport, need)
        skip = pytest.mark.skipif(torch.cuda.device_count() < need,
                                  reason=f"needs {need} GPUs (CUDA has {torch.cuda.device_count()})")
        return pytest.mark.gpu(skip(test))
    return mark


@pytest.mark.fast
def test_each_gpu_run_is_skipped_unless_there_are_the_gpus_its_layout_needs():
    """The layout check refuses two ranks of one GPU in an NCCL group, so 1 trainer + 1 engine needs 2 GPUs
    (on 1, train.py would refuse it, not test it), FSDP over 2 trainers beside 2 engines 4, and --colocate's
    2 + 2 pairs 2; each GPU test asks for what its own layout needs, and runs on exactly that many."""
    assert [gpus_needed(*layout) for layout in ((2, 1, "group"), (4, 2, "group"), (4, 2, "ipc"))] == [2, 4, 2]
    runs = [f for name, f in globals().items() if name.startswith("test_gpu_")]
    assert runs and all(hasattr(f, "layout") for f in runs)
    for f in runs:
        ranks, train, transport, need = f.layout
        [skip] = [m for m in f.pytestmark if m.name == "skipif"]
        assert skip.args == (torch.cuda.device_count() < need,)
        assert f"needs {need} GPUs" in skip.kwargs["reason"]


def torchrun(tmp_path, test, *args):
    """`test`'s layout under torchrun on the first GPUs it needs (CUDA_VISIBLE_DEVICES: on a larger machine
    the layout check would otherwise pair --colocate's ranks across GPUs)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tools.jobs import free_port_pair
    ranks, train, _, need = test.layout
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(need)]
    out = tmp_path / "run"
    r = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(ranks),
                        "--master-port", str(free_port_pair()), "train.py", "--out-dir", str(out),
                        "--train-gpus", str(train), "--rollout-gpus", str(ranks - train),
                        "--steps", "3", "--batch-groups", "4", "--group-size", "4", "--check-sync-every", "1",
                        "--timeout-s", "300", "--save-every", "0", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(ids[:need])})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@gpu_run(2, 1)
def test_gpu_one_trainer_one_engine_probe_after_every_sync(tmp_path):
    # float32 on both sides (--precision's GPU default is bf16): the engine holds the trainer's weights
    rows = torchrun(tmp_path, test_gpu_one_trainer_one_engine_probe_after_every_sync, "--dtype", "float32",
                    "--precision", "fp32")
    assert all(r["sync_probe_max_diff"] < 1e-3 for r in rows)


@gpu_run(4, 2)
def test_gpu_two_engines_on_two_devices_and_fsdp_over_two_trainer_ranks(tmp_path):
    # 12 samples: uneven shards
    from runlog import PROBE_TOLERANCE
    rows = torchrun(tmp_path, test_gpu_two_engines_on_two_devices_and_fsdp_over_two_trainer_ranks,
                    "--batch-groups", "3")
    # bf16 engines and a bf16 trainer (sharded start, mixed precision): bf16's tolerance
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync_probe_max_diff"] < PROBE_TOLERANCE["bf16"] for r in rows)


@gpu_run(4, 2, "ipc")
def test_gpu_colocated_sync_baseline(tmp_path):
    """--colocate on 2 GPUs, 4 processes: the weights by CUDA IPC (no NCCL group holds two ranks of one
    GPU), the engines' memory share computed from what is free, sleep and wake around training."""
    from runlog import PROBE_TOLERANCE
    rows = torchrun(tmp_path, test_gpu_colocated_sync_baseline, "--colocate", "--async-ratio", "0")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["staleness_max"] == 0 for r in rows)
    assert all(r["sync_probe_max_diff"] < PROBE_TOLERANCE["bf16"] for r in rows)
