"""weight_sync.py without engines: the bucket plan, the sender and the worker side over real gloo
groups (worker processes whose model runner is a stand-in that records what reload_weights got),
new generations, a member that dies mid-broadcast. The real engines: tests/test_engine.py."""

import dataclasses
import datetime
import multiprocessing
import os
import signal
import time

import pytest
import torch

from weight_sync import Sender, WeightSyncWorker, layout_bytes, plan_buckets, weight_layout

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


def _worker(first_rank: int, specs: list, layout, out: str, die_at_tensor: int = -1, ready=None):
    """One engine worker: receive one sync per spec, save what was loaded after each. `ready` is set once
    its imports are done (the group's helpers included), so a short group timeout times the sync, not
    the start of a process on a busy machine."""
    import vllm.distributed.utils  # noqa: F401  (what open_group imports)
    ready.set()
    w = WeightSyncWorker()
    w.model_runner, w.rank = RecordingRunner(), 0
    if die_at_tensor >= 0:         # a worker that dies mid-broadcast (an engine crash)
        def dying(weights_iterator, is_checkpoint_format=True):
            for k, _ in enumerate(weights_iterator):
                if k == die_at_tensor:
                    os.kill(os.getpid(), signal.SIGKILL)
        w.model_runner.reload_weights = dying
    for k, spec in enumerate(specs):
        w.receive_weights(spec, first_rank, layout)
        torch.save(w.model_runner.got, f"{out}.{first_rank}.{k}")


def start_workers(specs, layout, out, ranks=(1, 2), die=None):
    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in ranks]
    procs = [ctx.Process(target=_worker, args=(r, [dataclasses.asdict(s) for s in specs], layout, str(out),
                                               (die or {}).get(r, -1), e)) for r, e in zip(ranks, ready)]
    for p in procs:
        p.start()
    for r, e in zip(ranks, ready):
        assert e.wait(120), f"test worker (weight-sync rank {r}): not started within 120 s"
    return procs


@pytest.mark.fast
def test_bucket_plan_covers_every_weight_in_order_one_dtype_per_bucket():
    layout = weight_layout(NAMED)
    plan = plan_buckets(layout, 4096)
    assert [i for b in plan for i in b] == list(range(len(NAMED))) and len(plan) >= 3
    assert all(len({layout[i][2] for i in b}) == 1 for b in plan)
    assert layout_bytes(layout) == sum(t.numel() * t.element_size() for _, t in NAMED)


def test_two_workers_get_every_weight_bit_exact_and_in_the_meta_dtype(tmp_path):
    sender = Sender(timeout_s=60, bucket_bytes=4096)
    spec = sender.spec(0, 2)
    floats = [(n, t) for n, t in NAMED if t.is_floating_point()]
    layout = weight_layout(floats, "bfloat16")                   # the engine's dtype: cast by the sender
    procs = start_workers([spec], layout, tmp_path / "w")
    sender.send(spec, iter(floats), layout)                     # an iterator: consumed bucket by bucket
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
    layout = weight_layout(NAMED)
    specs = [sender.spec(0, 2), sender.spec(0, 2), sender.spec(1, 2)]
    procs = start_workers(specs, layout, tmp_path / "w")
    for k, spec in enumerate(specs):
        sender.send(spec, [(n, t + k if t.is_floating_point() else t) for n, t in NAMED], layout)
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
    layout = weight_layout(big)
    procs = start_workers([spec], layout, tmp_path / "w", die={2: 0})
    pulled = []

    def source():
        for n, t in big:
            pulled.append(n)
            yield n, t
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"trainer rank 0: weight broadcast bucket \d+ \(gen 0\)"):
        sender.send(spec, source(), layout)
    assert time.monotonic() - t0 < 30 and pulled == [n for n, _ in big]
    assert sender.pg is None                      # a failed group is not used again
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    # the survivor's receive fails too
    assert procs[1].exitcode == -signal.SIGKILL and procs[0].exitcode != 0


class FailingGroup:
    """A weight-sync group whose every broadcast fails in its wait, as an NCCL group in blocking-wait mode
    does when a member died (or at the timeout); it logs the waits' timeouts and its abort."""

    def __init__(self):
        self.log = []

    def broadcast(self, t, src):
        log = self.log

        class Work:
            def wait(self, timeout=None):
                log.append(("wait", timeout))
                raise RuntimeError("NCCL error: remote process exited or there was a network error")
        return Work()

    def abort(self):
        self.log.append(("abort",))


def test_a_failed_wait_is_bounded_and_aborts_that_group_on_both_sides(monkeypatch):
    """Each wait in the weight-sync group carries the group's timeout (an NCCL wait without one only
    orders streams and never raises), and a failed one aborts that group, on the sender and on a worker;
    the next sync forms the group again."""
    import weight_sync
    opened = []
    monkeypatch.setattr(weight_sync, "open_group",
                        lambda spec, rank, store=None: opened.append(FailingGroup()) or opened[-1])
    sender = Sender(timeout_s=7)
    spec = sender.spec(0, 1)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"trainer rank 0: weight broadcast bucket 0 \(gen 0\) failed"):
            sender.send(spec, iter(NAMED), weight_layout(NAMED))
        assert sender.pg is None
    # each sync formed the group anew; each wait was bounded, and the failed group aborted
    assert [g.log for g in opened] == [[("wait", datetime.timedelta(seconds=7)), ("abort",)]] * 2

    worker = WeightSyncWorker()
    worker.model_runner = RecordingRunner()
    worker._sync_pg, worker._sync_gen = FailingGroup(), (spec.host, spec.port, spec.prefix, spec.gen)
    log = worker._sync_pg.log
    with pytest.raises(RuntimeError, match=r"engine worker \(weight-sync rank 1, gen 0\): weight broadcast "
                                           r"bucket 0 failed or timed out"):
        worker.receive_weights(dataclasses.asdict(spec), 1, weight_layout(NAMED))
    assert log == [("wait", datetime.timedelta(seconds=7)), ("abort",)]
    assert worker._sync_pg is None and worker._sync_gen is None


def test_the_nccl_group_is_built_to_raise_in_its_waits_with_no_watchdog(monkeypatch):
    """ProcessGroupNCCL reads TORCH_NCCL_BLOCKING_WAIT and TORCH_NCCL_ASYNC_ERROR_HANDLING in its constructor,
    once per group: the weight-sync group is built with blocking waits and no error handling (no watchdog
    to take the process down), and every other group keeps what the environment said before (the trainer
    group's FSDP waits must not block), also when building it fails."""
    from torch.distributed import TCPStore
    from vllm.platforms import current_platform

    import weight_sync
    names = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    before = {k: os.environ.get(k) for k in names}
    seen = []

    def build(backend, store, rank, size, timeout):
        seen.append(({k: os.environ.get(k) for k in names}, backend, rank, size, timeout))
        if len(seen) > 1:
            raise RuntimeError("ncclCommInitRank failed")
        return "group"
    monkeypatch.setattr(current_platform, "stateless_init_device_torch_dist_pg", build)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = weight_sync.GroupSpec("127.0.0.1", store.port, "t", 0, 3, backend="nccl", timeout_s=9)
    assert weight_sync.open_group(spec, 2, store) == "group"
    assert seen == [({"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, "nccl", 2, 3,
                     datetime.timedelta(seconds=9))]
    assert {k: os.environ.get(k) for k in names} == before
    with pytest.raises(RuntimeError, match="ncclCommInitRank"):
        weight_sync.open_group(spec, 2, store)
    assert {k: os.environ.get(k) for k in names} == before


def test_a_torch_engine_takes_each_sync_from_the_group_as_a_vllm_worker_does():
    """--engine torch (ext/torch_engine.py): a TorchEngine receives every sync over the real weight-sync group
    (this process is trainer rank 0's Sender and, in a thread, the engine's weight-sync rank 1) through
    WeightSyncWorker's own receive, paused: two syncs of generation 0 on one group, a third on generation
    1's new one. After each, its weights are the sender's bit for bit (the tied head with the embedding) and
    its probe scores are the forward's of those weights; the tensors arrived in buckets (several here)."""
    import asyncio

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ext.torch_engine import TorchEngine
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    engine = TorchEngine(Qwen2ForCausalLM(cfg).eval(), eos_token_ids={1})
    trainer = Qwen2ForCausalLM(cfg).eval()              # another draw: the weights the syncs bring
    sender = Sender(timeout_s=60, bucket_bytes=4096)
    ids = list(range(2, 30))

    async def main():
        groups = []
        for k, spec in enumerate([sender.spec(0, 1), sender.spec(0, 1), sender.spec(1, 1)]):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.01)
            named = [(n, t) for n, t in trainer.state_dict().items() if n != "lm_head.weight"]
            layout = weight_layout(named)
            await engine.pause("keep")
            _, [timings] = await asyncio.gather(asyncio.to_thread(sender.send, spec, iter(named), layout),
                                                engine.receive_weights(spec, 1, layout))
            await engine.resume()
            assert timings["tensors"] == len(named) and timings["total_s"] >= timings["wait_s"] >= 0
            own = engine.model.state_dict()
            assert all(torch.equal(own[n], t) for n, t in named)
            assert torch.equal(own["lm_head.weight"], own["model.embed_tokens.weight"])
            with torch.no_grad():
                logits = trainer(input_ids=torch.tensor([ids])).logits[0, :-1]
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            assert (torch.tensor(await engine.score(ids)) - want).abs().max().item() < 1e-5, k
            groups.append(engine._sync_worker._sync_pg)
        return groups
    assert len(plan_buckets(weight_layout(list(trainer.state_dict().items())), 4096)) > 3
    g0, g0_again, g1 = asyncio.run(main())
    assert g0 is g0_again and g1 is not g0 and sender.gen == 1
