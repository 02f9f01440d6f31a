"""trainer.py on CPU: logprob alignment, a learning step, FSDP2 over gloo, checkpoints (the weight broadcast:
test_weight_sync.py)."""

import json
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from buffer import Sample
from trainer import TrainConfig, Trainer, collate, token_logprobs


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
        out.append(Sample(f"t{i}", f"g{i // 2}", prompt, resp, lp, [1] * resp_len, [0] * resp_len,
                          float(i % 2)))
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


def _fsdp_worker(rank, world, port, model_dir, samples, adv, out, train_kw=None, lora_rank=0):
    """One of `world` FSDP2 ranks trains its shard once; rank 0 saves the full weights (or adapter)."""
    from lora import LoraConfig
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tr = Trainer(model_dir, TrainConfig(**(train_kw or dict(loss="ppo", lr=1e-3))), dist.group.WORLD,
                 lora=LoraConfig(lora_rank=lora_rank))
    tr.train_step(samples[rank::world], adv[rank::world])
    named = tr.full_state()
    if rank == 0:
        torch.save(dict(named), out)
    dist.barrier()               # every rank done before any tears the group down (a rank that
    dist.destroy_process_group()  # left first once died in gloo's teardown: SIGABRT)


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


# ---------------------------------------------------------------------------------------------
# mini-batches, epochs, recomputed old logprobs, the engine/trainer gap


def test_decoupled_ppo_clip_binds_after_the_first_mini_batch(tiny_model_dir):
    """The proximal logprobs are frozen before the batch's first update: the first mini-batch is
    on-policy (ratio 1, nothing clipped); once the weights moved, later ones clip. With one step
    per batch the clip can never bind (the old behaviour this replaces)."""
    samples = make_samples(tiny_model_dir, n=8)
    adv = [1.0, -1.0] * 4
    tr = Trainer(str(tiny_model_dir), TrainConfig(loss="decoupled_ppo", lr=3e-2, warmup_steps=1,
                                                  mini_batches=4, ppo_epochs=2, clip_low=0.05,
                                                  clip_high=0.05))
    m = tr.train_step(samples, adv)
    clip = [u["clip_frac"] for u in tr.update_metrics]
    assert len(clip) == 8 and m["num_updates"] == 8
    assert clip[0] == 0 and tr.update_metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert max(clip[1:]) > 0.1
    one = Trainer(str(tiny_model_dir), TrainConfig(loss="decoupled_ppo", lr=3e-2, warmup_steps=1,
                                                   clip_low=0.05, clip_high=0.05))
    assert one.train_step(samples, adv)["clip_frac"] == 0


def test_recompute_old_logprobs_replaces_the_engines(tiny_model_dir):
    """--recompute-old-logprobs: the old logprobs are the trainer's own before the update, so the
    first update is on-policy whatever the engine reported; the gap to the engine's is reported."""
    samples = make_samples(tiny_model_dir, n=4)
    for s in samples:
        s.logprobs = [lp - 0.5 for lp in s.logprobs]          # an engine 0.5 nats off on every token
    adv = [1.0, -1.0, 1.0, -1.0]
    engine = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo")).train_step(samples, adv)
    recomputed = Trainer(str(tiny_model_dir),
                         TrainConfig(loss="ppo", recompute_old_logprobs=True)).train_step(samples, adv)
    assert engine["ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert recomputed["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert engine["logp_diff_all"] == pytest.approx(0.5, abs=1e-4)
    assert recomputed["logp_diff_all"] == pytest.approx(0.5, abs=1e-4)


def test_recompute_keeps_mu_in_decoupled_ppos_weight(tiny_model_dir):
    """--recompute-old-logprobs moves the ratio to pi_prox, but decoupled_ppo's w = pi_prox / mu keeps
    the engine's mu (it used to become pi_prox / pi_prox = 1, discarding the behaviour policy)."""
    samples = make_samples(tiny_model_dir, n=4)
    for s in samples:
        s.logprobs = [lp - 0.5 for lp in s.logprobs]          # mu 0.5 nats under the trainer on every token
    cfg = TrainConfig(loss="decoupled_ppo", recompute_old_logprobs=True)
    out = Trainer(str(tiny_model_dir), cfg).train_step(samples, [1.0, -1.0, 1.0, -1.0])
    assert out["is_weight_mean"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert out["approx_kl"] == pytest.approx(math.exp(0.5) - 1 - 0.5, rel=1e-3)     # KL(mu || pi): mu's


def test_logprob_gap_separates_staleness_from_mismatch(tiny_model_dir):
    """Samples wholly of the trainer's version are on-policy: their gap is numerical mismatch only
    (here ~0: same weights, float32); the stale half carries the policy lag."""
    samples = make_samples(tiny_model_dir, n=4)
    for i, s in enumerate(samples):
        s.versions = [5 if i % 2 == 0 else 4] * len(s.response_ids)
        if i % 2:
            s.logprobs = [lp - 0.3 for lp in s.logprobs]      # generated by an older policy
    m = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo")).train_step(samples, [1.0, -1.0, 1.0, -1.0],
                                                                         version=5)
    assert m["logp_diff_on_policy"] < 1e-5
    assert m["logp_diff_all"] == pytest.approx(0.15, abs=1e-4)


def _uneven_worker(rank, world, port, model_dir, samples, adv, out):
    from datetime import timedelta
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a hang fails
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    tr = Trainer(model_dir, TrainConfig(loss="decoupled_ppo", lr=1e-3, micro_batch=1, mini_batches=2),
                 dist.group.WORLD)
    for _ in range(2):
        m = tr.train_step(samples[rank::world], adv[rank::world])
    torch.save({"weights": dict(tr.full_state()), "updates": m["num_updates"]}, f"{out}.{rank}")
    dist.barrier()               # every rank done before any tears the group down (a rank that
    dist.destroy_process_group()  # left first once died in gloo's teardown: SIGABRT)


def test_fsdp_ranks_with_uneven_shards_run_the_same_passes(tiny_model_dir, tmp_path):
    """4 samples over 3 FSDP ranks with micro-batches of 1 and 2 mini-batches: shards of 2, 1 and 1
    samples. Every forward/backward is a collective, so the short ranks run empty micro-batches in
    step; without that they would wait forever (here: the 60 s gloo timeout). All ranks end with
    the same weights."""
    samples = make_samples(tiny_model_dir, n=4)
    adv = [1.0, -1.0, 0.5, -0.5]
    out = str(tmp_path / "r")
    mp.spawn(_uneven_worker, args=(3, free_port(), str(tiny_model_dir), samples, adv, out), nprocs=3)
    got = [torch.load(f"{out}.{r}") for r in range(3)]
    assert [g["updates"] for g in got] == [2, 2, 2]
    for k, v in got[0]["weights"].items():
        assert all(torch.equal(v, g["weights"][k]) for g in got[1:]), k


def test_is_correction_weighs_the_trainer_against_the_engines_logprobs(tiny_model_dir):
    """--is-correction: pi_prox is computed before the update and weighed against the samples' engine
    logprobs: nothing to correct when they agree, truncation when the engine's are off by log 3."""
    import dataclasses
    samples = make_samples(tiny_model_dir)
    cfg = TrainConfig(loss="ppo", is_correction="tis", is_cap=2.0)
    on = Trainer(str(tiny_model_dir), cfg).train_step(samples, [1.0, -1.0, 1.0, -1.0])
    assert on["mismatch_kl"] < 1e-6 and on["is_corrected_frac"] == 0.0
    stale = [dataclasses.replace(s, logprobs=[lp - math.log(3.0) for lp in s.logprobs]) for s in samples]
    off = Trainer(str(tiny_model_dir), cfg).train_step(stale, [1.0, -1.0, 1.0, -1.0])
    assert off["is_corrected_frac"] == 1.0 and off["is_weight_max"] == pytest.approx(2.0)
    assert off["mismatch_kl"] == pytest.approx(3.0 - 1.0 - math.log(3.0), rel=1e-4)
    both = Trainer(str(tiny_model_dir), dataclasses.replace(cfg, recompute_old_logprobs=True)).train_step(
        stale, [1.0, -1.0, 1.0, -1.0])                    # the flag and a correction combine: mu still weighs
    assert both["is_corrected_frac"] == 1.0 and both["mismatch_kl"] == pytest.approx(off["mismatch_kl"])
