"""trainer.py on CPU: logprob alignment, a learning step, FSDP2 over gloo, bucketed broadcast, checkpoints."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from buffer import Sample
from trainer import (TrainConfig, Trainer, broadcast_weights, collate, plan_buckets, receive_weights,
                     token_logprobs, weight_meta)


def make_samples(model_dir, n=4, resp_len=5, seed=0):
    """Samples whose behaviour logprobs are the model's own (on-policy), equal lengths."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(2, 20, (4,), generator=g).tolist()
        resp = torch.randint(2, 20, (resp_len,), generator=g).tolist()
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt):].tolist()
        out.append(Sample(f"t{i}", f"g{i // 2}", prompt, resp, lp, [1] * resp_len, [0] * resp_len, float(i % 2)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collate_alignment_gives_ratio_one_on_policy(tiny_model_dir):
    samples = make_samples(tiny_model_dir)
    tr = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo"))
    t = collate(samples, "cpu")
    with torch.no_grad():
        logp = token_logprobs(tr.model, t["input_ids"], t["attn"])
    diff = ((logp - t["old_logp"]) * t["mask"]).abs().max().item()
    assert diff < 1e-5 and t["mask"].sum().item() == 4 * 5
    assert t["mask"][:, :4].sum().item() == 0          # prompt tokens never count


def test_train_step_moves_logprobs_along_advantages(tiny_model_dir):
    samples = make_samples(tiny_model_dir)
    adv = [1.0, -1.0, 1.0, -1.0]
    tr = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo", lr=1e-3))
    t = collate(samples, "cpu")
    with torch.no_grad():
        before = (token_logprobs(tr.model, t["input_ids"], t["attn"]) * t["mask"]).sum(1)
    m = tr.train_step(samples, adv)
    with torch.no_grad():
        after = (token_logprobs(tr.model, t["input_ids"], t["attn"]) * t["mask"]).sum(1)
    delta = (after - before).tolist()
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["grad_norm"] > 0


def _fsdp_worker(rank, world, port, model_dir, samples, adv, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tr = Trainer(model_dir, TrainConfig(loss="ppo", lr=1e-3), dist.group.WORLD)
    tr.train_step(samples[rank::world], adv[rank::world])
    named = tr.full_state()
    if rank == 0:
        torch.save(dict(named), out)
    dist.destroy_process_group()


def test_fsdp2_two_ranks_matches_single_process(tiny_model_dir, tmp_path):
    """FSDP2 over 2 gloo ranks, each with half the batch, ends at the same weights as one process
    with the whole batch (equal token counts per rank, token-mean loss)."""
    samples = make_samples(tiny_model_dir)
    adv = [1.0, -1.0, 0.5, -0.5]
    single = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo", lr=1e-3))
    single.train_step(samples, adv)
    ref = dict(single.full_state())
    out = tmp_path / "fsdp.pt"
    mp.spawn(_fsdp_worker, args=(2, free_port(), str(tiny_model_dir), samples, adv, str(out)), nprocs=2)
    got = torch.load(out)
    assert set(got) == set(ref)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


def _broadcast_worker(rank, world, port, named, bucket_bytes, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 0:
        broadcast_weights(named, dist.group.WORLD, bucket_bytes, "cpu", "trainer rank 0")
    else:
        got = receive_weights(weight_meta(named), dist.group.WORLD, bucket_bytes, "cpu", f"rollout rank {rank}")
        torch.save(got, f"{out}.{rank}")
    dist.destroy_process_group()


def test_bucketed_broadcast_delivers_named_weights(tmp_path):
    named = [("a.weight", torch.randn(100, 10)), ("a.bias", torch.randn(10)), ("b.weight", torch.randn(64, 64)),
             ("steps", torch.arange(7)), ("c.weight", torch.randn(3, 3))]
    bucket_bytes = 4096
    plan = plan_buckets(weight_meta(named), bucket_bytes)
    assert len(plan) >= 3 and sorted(i for b in plan for i in b) == list(range(len(named)))
    mp.spawn(_broadcast_worker, args=(3, free_port(), named, bucket_bytes, str(tmp_path / "w")), nprocs=3)
    for r in (1, 2):
        got = torch.load(tmp_path / f"w.{r}")
        assert [n for n, _ in got] == [n for n, _ in named]
        for (_, a), (_, b) in zip(got, named):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_checkpoint_is_a_loadable_hf_dir_and_restores_optimizer(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    samples = make_samples(tiny_model_dir)
    tr = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo", lr=1e-3))
    tr.train_step(samples, [1.0, -1.0, 1.0, -1.0])
    tr.save_checkpoint(str(tmp_path), {"step": 1, "version": 1, "data_position": 20}, str(tiny_model_dir))
    ck = tmp_path / "checkpoint"
    assert json.loads((ck / "state.json").read_text())["version"] == 1
    loaded = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    for (n, a), b in zip(tr.model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n
    tr2 = Trainer(str(ck), TrainConfig(loss="ppo", lr=1e-3))
    tr2.load_optimizer(ck)
    s1 = tr.opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(tr2.opt.state_dict()["state"][0]["exp_avg"], s1)
    assert not list(tmp_path.glob("*.tmp")) and (tmp_path / "checkpoint").is_symlink()
