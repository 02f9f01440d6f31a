"""ext/colocate.py's ipc transport without engines: the ipc transport's sender in this process, the worker
side in
another (spawned: a fresh interpreter that shares nothing with this one but the store's address and
the shared-memory files) with a model runner that records what reload_weights got. Bit-exact
tensors, buffers reused, every failure (a worker killed, a loader that raises, a sender that fails)
ending both sides at once or at the timeout, naming the bucket and the phase; the shared-memory
files gone after a killed sender. The real engine: tests/test_engine.py; the GPU layout: test_layout."""

import dataclasses
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_weight_sync import NAMED, RecordingRunner
from ext.colocate import BUFFERS, IpcSender
from weight_sync import WeightSyncWorker, plan_buckets, weight_layout

FLOATS = [(n, t) for n, t in NAMED if t.is_floating_point()]


def _worker(specs: list, layout, out: str, die_at_tensor: int = -1, raise_at_tensor: int = -1,
            device: str = "cpu", visible: str | None = None):
    """Engine 0's worker: one receive_weights (the ipc receiver: engine 0, first rank 1) per spec; what was
    loaded, and the slots' addresses
    (the sender's buffers as this process mapped them), saved after each; an error, saved too.
    device, visible: a GPU worker's device and CUDA_VISIBLE_DEVICES (as an engine's worker has)."""
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    w = WeightSyncWorker()
    w.model_runner, w.rank = RecordingRunner(), 0
    w.model_runner.device = torch.device(device)
    if die_at_tensor >= 0 or raise_at_tensor >= 0:
        def failing(weights_iterator, is_checkpoint_format=True):
            for k, _ in enumerate(weights_iterator):
                if k == die_at_tensor:
                    os.kill(os.getpid(), signal.SIGKILL)       # an engine crash
                if k == raise_at_tensor:
                    raise ValueError("vLLM's loader refused a weight")
        w.model_runner.reload_weights = failing
    for k, spec in enumerate(specs):
        try:
            out_k = w.receive_weights(spec, 1, layout)
        except Exception as e:
            Path(f"{out}.error").write_text(str(e))
            raise SystemExit(1)
        torch.save({"got": [(n, t.cpu()) for n, t in w.model_runner.got], "out": out_k,
                    "slots": {s: t.data_ptr() for s, t in w._ipc_slots.items()}}, f"{out}.{k}")


def start_worker(specs, layout, out, **kw):
    p = multiprocessing.get_context("spawn").Process(
        target=_worker, args=([dataclasses.asdict(s) for s in specs], layout, str(out)), kwargs=kw)
    p.start()
    return p


# on a GPU machine (not run here) the same code over CUDA IPC; the second as under --colocate: the trainer
# rank's buffers on its cuda:1, the engine's worker seeing only that GPU (CUDA_VISIBLE_DEVICES=1) as its
# cuda:0, so the handle's device index must be the worker's own
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.parametrize("device, worker", [
    ("cpu", None),
    pytest.param("cuda:0", {"device": "cuda:0"}, marks=needs_cuda, id="cuda"),
    pytest.param("cuda:1", {"device": "cuda:0", "visible": "1"}, marks=[needs_cuda, needs_2_gpus],
                 id="cuda-worker-numbers-the-gpu-otherwise")])
def test_three_syncs_bit_exact_in_the_engine_dtype_through_two_reused_buffers(tmp_path, device, worker):
    sender = IpcSender(timeout_s=60, bucket_bytes=4096, device=device)
    layout = weight_layout(FLOATS, "bfloat16")                        # the engine's dtype: cast by the sender
    assert len(plan_buckets(layout, 4096)) > BUFFERS                   # buffers must be reused within a sync
    specs = [sender.spec().with_gen(0, k) for k in (1, 2, 3)]
    p = start_worker(specs, layout, tmp_path / "w", **(worker or {}))
    ptrs = []
    for k, spec in enumerate(specs):
        sender.send(spec, iter([(n, t + k) for n, t in FLOATS]), layout)     # an iterator: bucket by bucket
        ptrs.append([b.data_ptr() for b in sender.bufs])
    p.join(60)
    assert p.exitcode == 0
    assert len(ptrs[0]) == BUFFERS and ptrs == [ptrs[0]] * 3        # the same buffers every sync
    seen = []
    for k in range(3):
        r = torch.load(tmp_path / f"w.{k}")
        assert [n for n, _ in r["got"]] == [n for n, _ in FLOATS] and r["out"]["tensors"] == len(FLOATS)
        for (_, a), (_, b) in zip(r["got"], FLOATS):
            assert a.dtype == torch.bfloat16 and torch.equal(a, (b + k).to(torch.bfloat16))
        seen.append(r["slots"])
    assert len(seen[0]) == BUFFERS and seen == [seen[0]] * 3        # the worker mapped each buffer once
    assert sender.store.num_keys() == 0                             # every key read and deleted


def test_a_killed_worker_fails_the_sender_at_its_timeout_naming_the_bucket_and_the_phase(tmp_path):
    """No one tells the sender (here no rollout rank watches the engine): its wait for the ack that
    frees a buffer ends at the spec's timeout; the iterator is still drained (FSDP's gathers)."""
    sender = IpcSender(timeout_s=3, bucket_bytes=4096)
    layout = weight_layout(FLOATS)
    spec = sender.spec().with_gen(0, 1)
    p = start_worker([spec], layout, tmp_path / "w", die_at_tensor=0)
    pulled = []

    def source():
        for n, t in FLOATS:
            pulled.append(n)
            yield n, t
    with pytest.raises(TimeoutError, match=r"trainer rank 0 -> engine 0 \(weight-sync ipc, gen 0, sync 1\): "
                                           r"bucket \d+: waiting for the worker's ack.*within 3s"):
        sender.send(spec, source(), layout)
    assert pulled == [n for n, _ in FLOATS]
    p.join(30)
    assert p.exitcode == -signal.SIGKILL


def test_a_loader_error_in_the_worker_ends_the_sender_at_once_with_its_reason(tmp_path):
    sender = IpcSender(timeout_s=60, bucket_bytes=4096)
    layout = weight_layout(FLOATS)
    spec = sender.spec().with_gen(0, 1)
    p = start_worker([spec], layout, tmp_path / "w", raise_at_tensor=2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"bucket \d+: waiting for the worker's ack.*the other side "
                                           r"failed: engine 0's worker .*vLLM's loader refused a weight"):
        sender.send(spec, iter(FLOATS), layout)
    assert time.monotonic() - t0 < 30                               # not the 60 s timeout
    p.join(30)
    assert p.exitcode == 1 and "refused" in (tmp_path / "w.error").read_text()


def test_a_sender_that_fails_ends_the_worker_at_once_naming_the_bucket(tmp_path):
    """The trainer's side fails after the first bucket (an FSDP gather, say): the worker's wait for the
    next bucket ends with the sender's reason, not at its 60 s timeout."""
    sender = IpcSender(timeout_s=60, bucket_bytes=4096)
    layout = weight_layout(FLOATS)
    spec = sender.spec().with_gen(0, 1)
    p = start_worker([spec], layout, tmp_path / "w")

    def source():
        yield from FLOATS[:2]
        raise OSError("gather failed")
    t0 = time.monotonic()
    with pytest.raises(OSError, match="gather failed"):
        sender.send(spec, source(), layout)
    p.join(30)
    error = (tmp_path / "w.error").read_text()
    assert p.exitcode == 1 and time.monotonic() - t0 < 30
    assert re.search(r"engine 0's worker \(weight-sync ipc, gen 0, sync 1\): bucket \d+: waiting for it: the "
                     r"other side failed: trainer rank 0 .*gather failed", error), error


SENDER = """
import sys, torch
from ext.colocate import IpcSender
from weight_sync import weight_layout
named = [("w", torch.randn(1 << 18))]
s = IpcSender(timeout_s=60, bucket_bytes=1 << 20)
s._buffers(1 << 20)
print(s.store.port, flush=True)
sys.stdin.read()          # until killed
"""


def test_the_shared_memory_of_a_killed_sender_is_unlinked():
    """A trainer rank killed with its buffers mapped (SIGKILL: no destructor runs): torch's
    torch_shm_manager unlinks the files once no process holds them."""
    p = subprocess.Popen([sys.executable, "-c", SENDER], cwd=Path(__file__).resolve().parent.parent,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdout.readline()                              # the buffers exist
    mine = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{p.pid}_")]
    assert len(mine) == BUFFERS
    p.kill()
    p.wait(30)
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/dev/shm/{f}") for f in mine) and time.monotonic() < deadline:
        time.sleep(0.1)                              # (polling a condition, with a deadline)
    assert not any(os.path.exists(f"/dev/shm/{f}") for f in mine)


# ---------------------------------------------------------------------------------------------
# on a GPU machine (not run here): CUDA IPC, the same code


@needs_cuda
@needs_2_gpus
def test_cuda_ipc_into_a_worker_on_another_gpu_is_refused_naming_both(tmp_path):
    sender = IpcSender(timeout_s=60, bucket_bytes=4096, device="cuda:0")
    layout = weight_layout(FLOATS)
    spec = sender.spec().with_gen(0, 1)
    p = start_worker([spec], layout, tmp_path / "w", device="cuda:0", visible="1")
    with pytest.raises(RuntimeError, match="the other side failed"):
        sender.send(spec, iter(FLOATS), layout)
    p.join(60)
    assert "CUDA IPC hands over memory of one GPU" in (tmp_path / "w.error").read_text()
