"""weight_sync.py without engines: the bucket plan, the sender and the worker side over real gloo
groups (worker processes whose model runner is a stand-in that records what reload_weights got),
new generations, a member that dies mid-broadcast. The real engines: tests/test_engine.py."""

import dataclasses
import multiprocessing
import os
import signal
import time

import pytest
import torch

from weight_sync import Sender, WeightSyncWorker, meta_bytes, plan_buckets, weight_meta

NAMED = [("a.weight", torch.randn(100, 10)), ("a.bias", torch.randn(10)), ("b.weight", torch.randn(64, 64)),
         ("steps", torch.arange(7)), ("c.weight", torch.randn(3, 3))]


class RecordingRunner:
    """A model runner's two calls that the worker side uses; reload_weights keeps copies of what arrives."""
    device = torch.device("cpu")

    def __init__(self):
        self.got = []

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        self.got = [(n, t.clone()) for n, t in weights_iterator]

    def get_model(self):
        return torch.nn.Module()


def _worker(first_rank: int, specs: list, meta, out: str, die_at_tensor: int = -1):
    """One engine worker: receive one sync per spec, save what was loaded after each."""
    w = WeightSyncWorker()
    w.model_runner, w.rank = RecordingRunner(), 0
    if die_at_tensor >= 0:         # a worker that dies mid-broadcast (an engine crash)
        def dying(weights_iterator, is_checkpoint_format=True):
            for k, _ in enumerate(weights_iterator):
                if k == die_at_tensor:
                    os.kill(os.getpid(), signal.SIGKILL)
        w.model_runner.reload_weights = dying
    for k, spec in enumerate(specs):
        w.receive_weights(spec, first_rank, meta)
        torch.save(w.model_runner.got, f"{out}.{first_rank}.{k}")


def start_workers(specs, meta, out, ranks=(1, 2), die=None):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, [dataclasses.asdict(s) for s in specs], meta, str(out),
                                               (die or {}).get(r, -1))) for r in ranks]
    for p in procs:
        p.start()
    return procs


def test_bucket_plan_covers_every_weight_in_order_one_dtype_per_bucket():
    meta = weight_meta(NAMED)
    plan = plan_buckets(meta, 4096)
    assert [i for b in plan for i in b] == list(range(len(NAMED))) and len(plan) >= 3
    assert all(len({meta[i][2] for i in b}) == 1 for b in plan)
    assert meta_bytes(meta) == sum(t.numel() * t.element_size() for _, t in NAMED)


def test_two_workers_get_every_weight_bit_exact_and_in_the_meta_dtype(tmp_path):
    sender = Sender(timeout_s=60, bucket_bytes=4096)
    spec = sender.spec(0, 2)
    floats = [(n, t) for n, t in NAMED if t.is_floating_point()]
    meta = weight_meta(floats, "bfloat16")                   # the engine's dtype: cast by the sender
    procs = start_workers([spec], meta, tmp_path / "w")
    sender.send(spec, iter(floats), meta)                     # an iterator: consumed bucket by bucket
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for r in (1, 2):
        got = torch.load(tmp_path / f"w.{r}.0")
        assert [n for n, _ in got] == [n for n, _ in floats]
        for (_, a), (_, b) in zip(got, floats):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))


def test_a_new_generation_forms_a_new_group_and_mixed_dtypes_travel_as_they_are(tmp_path):
    """Two syncs in generation 0, then a third in generation 1 (what follows an engine's
    replacement): every member joins the new group and the weights arrive each time."""
    sender = Sender(timeout_s=60, bucket_bytes=4096)
    meta = weight_meta(NAMED)
    specs = [sender.spec(0, 2), sender.spec(0, 2), sender.spec(1, 2)]
    procs = start_workers(specs, meta, tmp_path / "w")
    for k, spec in enumerate(specs):
        sender.send(spec, [(n, t + k if t.is_floating_point() else t) for n, t in NAMED], meta)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sender.gen == 1
    for k in range(3):
        got = dict(torch.load(tmp_path / f"w.2.{k}"))
        assert torch.equal(got["a.weight"], NAMED[0][1] + k) and torch.equal(got["steps"], NAMED[3][1])


def test_a_worker_that_dies_mid_broadcast_fails_the_sender_naming_the_bucket_and_the_iterator_is_drained(
        tmp_path):
    """Worker 2 dies on its first tensor, while 32 MB more are on their way (more than a socket
    buffers): the sender fails within seconds, naming the bucket and the generation; it still pulls
    every weight (FSDP's gathers behind the iterator); the other worker's receive fails too."""
    big = [("x", torch.randn(1000)), ("big1", torch.randn(2048, 2048)), ("big2", torch.randn(2048, 2048))]
    sender = Sender(timeout_s=10, bucket_bytes=4 << 20)
    spec = sender.spec(0, 2)
    meta = weight_meta(big)
    procs = start_workers([spec], meta, tmp_path / "w", die={2: 0})
    pulled = []

    def source():
        for n, t in big:
            pulled.append(n)
            yield n, t
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"trainer rank 0: weight broadcast bucket \d+ \(gen 0\)"):
        sender.send(spec, source(), meta)
    assert time.monotonic() - t0 < 30 and pulled == [n for n, _ in big]
    assert sender.pg is None                      # a failed group is not used again
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    # the survivor's receive fails too
    assert procs[1].exitcode == -signal.SIGKILL and procs[0].exitcode != 0
