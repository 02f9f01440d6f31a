"""trainer.py on CPU: logprob alignment, a learning step, FSDP2 over gloo, checkpoints (the weight broadcast:
test_weight_sync.py)."""

import dataclasses
import json
import math
import os
import socket
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

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


@pytest.mark.fast
def test_collate_alignment_gives_ratio_one_on_policy(random_model_dir):
    samples = make_samples(random_model_dir)
    tr = Trainer(str(random_model_dir), TrainConfig(loss="ppo"))
    t = collate(samples, "cpu")
    with torch.no_grad():
        logp = token_logprobs(tr.model, t["input_ids"], t["attn"])
    diff = ((logp - t["old_logp"]) * t["mask"]).abs().max().item()
    assert diff < 1e-5 and t["mask"].sum().item() == 4 * 5
    assert t["mask"][:, :4].sum().item() == 0          # prompt tokens never count


@pytest.mark.fast
def test_train_step_moves_logprobs_along_advantages(random_model_dir):
    samples = make_samples(random_model_dir)
    adv = [1.0, -1.0, 1.0, -1.0]
    tr = Trainer(str(random_model_dir), TrainConfig(loss="ppo", lr=1e-3))
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
    from ext.lora import LoraConfig, lora_weights
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tr = Trainer(model_dir, TrainConfig(**(train_kw or dict(loss="ppo", lr=1e-3))), dist.group.WORLD,
                 weights=lora_weights(LoraConfig(lora_rank=lora_rank)))
    tr.train_step(samples[rank::world], adv[rank::world])
    named = tr.full_state()
    if rank == 0:
        torch.save(dict(named), out)
    dist.barrier()               # every rank done before any tears the group down (a rank that
    dist.destroy_process_group()  # left first once died in gloo's teardown: SIGABRT)


@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_fsdp2_two_ranks_matches_single_process(tiny_model_dir, tmp_path, checkpointing):
    """FSDP2 over 2 gloo ranks, each with half the batch, ends at the same weights as one process
    with the whole batch (equal token counts per rank, token-mean loss); also with activation
    checkpointing (the GPU default) recomputing each layer inside FSDP's hooks."""
    samples = make_samples(tiny_model_dir)
    adv = [1.0, -1.0, 0.5, -0.5]
    kw = dict(loss="ppo", lr=1e-3, grad_checkpointing=checkpointing)
    single = Trainer(str(tiny_model_dir), TrainConfig(**kw))
    single.train_step(samples, adv)
    ref = dict(single.full_state())
    out = tmp_path / "fsdp.pt"
    mp.spawn(_fsdp_worker, args=(2, free_port(), str(tiny_model_dir), samples, adv, str(out), kw), nprocs=2)
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


class HeldBytes:
    """Wraps trainer.iter_full_state: the bytes of the full weights it yielded that are alive at once, at
    most (`peak`). CPython frees a tensor when its last reference goes, so the count is exact."""

    def __init__(self, tr):
        self.now = self.peak = 0
        inner = tr.iter_full_state

        def counted(*args, **kwargs):
            for name, t in inner(*args, **kwargs):
                self.now += t.nbytes
                self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._freed, t.nbytes)
                yield name, t
        tr.iter_full_state = counted

    def _freed(self, nbytes):
        self.now -= nbytes


class GatherDtypes(TorchDispatchMode):
    """The dtype of every all-gather's input (DTensor.full_tensor: one per sharded weight)."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_gather" in str(func):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


class RecordingSender:
    """Trainer rank 0's sender, without engines: keeps what a sync hands it."""

    def send(self, group, named, meta):
        self.got = [(n, t.clone()) for n, t in named]


def _checkpoint_and_sync_worker(rank, world, port, model_dir, out_dir, result):
    """One of `world` FSDP ranks: a checkpoint, then a weight sync (TrainerRanks' own part, rank 0's sender
    a recording one) in bfloat16, the engine's dtype; what each held and gathered, saved per rank."""
    from ranks import TrainerRanks
    from weight_sync import GroupSpec, weight_layout
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tr = Trainer(model_dir, TrainConfig(loss="ppo"), dist.group.WORLD)
    held = HeldBytes(tr)
    tr.save_checkpoint(out_dir, {"step": 1}, model_dir)
    out = {"held": held.peak, "sizes": [t.numel() * 4 for _, t in tr.named_weights()]}
    ranks = TrainerRanks(tr, world, dist.group.WORLD, out_dir, model_dir, [],
                         store=dist.distributed_c10d._get_default_store())
    ranks.sender = RecordingSender() if rank == 0 else None
    meta = weight_layout(tr.named_weights(), "bfloat16")
    with GatherDtypes() as gathers:
        ranks._send(GroupSpec("127.0.0.1", port, "t", 0, 2), meta)
    out.update(gathers=gathers.dtypes, synced=ranks.sender.got if rank == 0 else None)
    torch.save(out, f"{result}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint_and_sync(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    mp.spawn(_checkpoint_and_sync_worker, args=(2, free_port(), str(tiny_model_dir), str(tmp / "out"),
                                                str(tmp / "r")), nprocs=2)
    return [torch.load(tmp / f"r.{r}") for r in range(2)], tmp / "out" / "checkpoint"


def test_a_checkpoint_leaves_no_full_copy_of_the_model_on_the_other_ranks(checkpoint_and_sync):
    """Every rank takes part in each gather (a collective), but only rank 0, which writes, keeps what it
    gathers: rank 1 holds at most two full weights at once (7B: not ~30 GB of float32 per rank)."""
    (r0, r1), ckpt = checkpoint_and_sync
    total, largest = sum(r0["sizes"]), max(r0["sizes"])
    assert r0["held"] == total                                # rank 0: the whole model, to write it
    assert r1["held"] <= 2 * largest < total / 4              # rank 1: the weight in hand, the next one
    assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer.rank1.pt").exists()


def test_a_sync_gathers_each_weight_already_in_the_engines_dtype(checkpoint_and_sync, tiny_model_dir):
    """A sync casts each rank's shard to the engine's dtype before the all-gather (bf16: half of float32's
    traffic and of the gathered weight), on every rank alike (the gather is a collective); rank 0's sender
    gets exactly the weights cast."""
    from transformers import AutoModelForCausalLM
    (r0, r1), _ = checkpoint_and_sync
    assert r0["gathers"] == r1["gathers"] == [torch.bfloat16] * len(r0["sizes"])
    want = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert [n for n, _ in r0["synced"]] == [n for n in want if n != "lm_head.weight"]   # (tied: left out)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, want[n].to(torch.bfloat16))
               for n, t in r0["synced"])


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


# ---------------------------------------------------------------------------------------------
# issue 30: a sharded start, bf16, token-budget micro-batches, KL to a reference, entropy


def _steps_worker(rank, world, port, model_dir, samples, adv, out, train_kw, steps=1, lora_rank=0):
    """One of `world` FSDP2 ranks: what its Trainer holds right after the start (no from_pretrained allowed:
    a sharded start reads only its own shards), then `steps` train steps on its shard of the batch."""
    from transformers import AutoModelForCausalLM

    from ext.lora import LoraConfig, lora_weights
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def refuse(*a, **kw):
        raise AssertionError("a trainer rank under FSDP loaded the whole model")
    AutoModelForCausalLM.from_pretrained = refuse
    tr = Trainer(model_dir, TrainConfig(**train_kw), dist.group.WORLD,
                 weights=lora_weights(LoraConfig(lora_rank=lora_rank)))
    lm = tr.model.get_base_model() if lora_rank else tr.model
    start = {"tied": lm.lm_head.weight is lm.model.embed_tokens.weight,
             "local": sum(p.to_local().numel() for p in tr.model.parameters()),
             "dtypes": sorted({str(p.dtype) for p in tr.model.parameters()}),
             "inv_freq": lm.model.rotary_emb.inv_freq.clone(),
             "weights": {n: v.full_tensor().clone() for n, v in tr.model.state_dict().items()},
             "probe": tr.probe_logprobs(list(range(2, 20)))}
    metrics = [tr.train_step(samples[rank::world], adv[rank::world]) for _ in range(steps)]
    grads = sorted({str(p.grad.dtype) for p in tr.model.parameters() if p.grad is not None})
    end = dict(tr.full_state())
    if rank == 0:
        torch.save({"start": start, "metrics": metrics, "grads": grads, "end": end}, out)
    dist.barrier()
    dist.destroy_process_group()


def spawn_steps(tmp_path, model_dir, samples, adv, train_kw, steps=1, lora_rank=0, world=2):
    out = tmp_path / "r0.pt"
    mp.spawn(_steps_worker, args=(world, free_port(), str(model_dir), samples, adv, str(out), train_kw, steps,
                                  lora_rank), nprocs=world)
    return torch.load(out)


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_sharded_start_holds_half_the_model_and_the_same_weights(tiny_model_dir, tmp_path, lora_rank):
    """2 FSDP ranks start without loading the whole model (from_pretrained refused in them): each holds
    half of every weight, the tied head is the embedding's tensor, the rotary tables are recomputed, and the
    weights (LoRA: base and the adapter's init) are exactly the single-rank trainer's."""
    from ext.lora import LoraConfig, lora_weights
    single = Trainer(str(tiny_model_dir), TrainConfig(),
                     weights=lora_weights(LoraConfig(lora_rank=lora_rank)))
    got = spawn_steps(tmp_path, tiny_model_dir, make_samples(tiny_model_dir), [1.0, -1.0, 1.0, -1.0],
                      dict(loss="ppo"), lora_rank=lora_rank)["start"]
    lm = single.model.get_base_model() if lora_rank else single.model
    total = sum(p.numel() for p in single.model.parameters())
    assert got["tied"] and abs(got["local"] - total / 2) < 0.01 * total
    assert torch.equal(got["inv_freq"], lm.model.rotary_emb.inv_freq)
    want = single.model.state_dict()
    assert set(got["weights"]) == set(want)
    assert all(torch.equal(got["weights"][n], want[n]) for n in want)
    assert got["probe"] == pytest.approx(single.probe_logprobs(list(range(2, 20))), abs=1e-6)


def test_bf16_keeps_float32_masters_and_learns(tiny_model_dir):
    """--precision bf16 on one rank: weights and AdamW moments stay float32, the forward runs in bfloat16
    (logprobs off the float32 ones by more than float32 rounding, by less than bf16's probe tolerance), and a
    step moves each sample's logprob along its advantage. What the engines get is in their dtype: bfloat16
    halves the sync's bytes."""
    from runlog import PROBE_TOLERANCE
    from weight_sync import layout_bytes, weight_layout
    samples = make_samples(tiny_model_dir)
    t = collate(samples, "cpu")
    fp32 = Trainer(str(tiny_model_dir), TrainConfig())
    tr = Trainer(str(tiny_model_dir), TrainConfig(lr=1e-3, precision="bf16"))
    with torch.no_grad():
        gap = (tr.logprobs(t) - fp32.logprobs(t)).abs().max().item()
        before = (tr.logprobs(t)).sum(1)
    assert 1e-4 < gap < PROBE_TOLERANCE["bf16"]
    tr.train_step(samples, [1.0, -1.0, 1.0, -1.0])
    with torch.no_grad():
        delta = (tr.logprobs(t).sum(1) - before).tolist()
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0
    assert {p.dtype for p in tr.model.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in tr.opt.state.values()} == {torch.float32}
    named = tr.named_weights()
    assert 2 * layout_bytes(weight_layout(named, "bfloat16")) == layout_bytes(weight_layout(named, "float32"))


def test_fsdp_bf16_computes_in_bfloat16_and_reduces_in_float32(tiny_model_dir, tmp_path):
    """2 FSDP ranks under the GPU defaults, --precision bf16 (MixedPrecisionPolicy) and activation
    checkpointing: float32 shards and float32 gradients (reduced in float32), a bfloat16 forward (its probe
    off the float32 one beyond float32 rounding), and the two ranks end with the single-rank bf16 trainer's
    weights to bf16 rounding of one Adam step."""
    samples = make_samples(tiny_model_dir)
    adv = [1.0, -1.0, 0.5, -0.5]
    kw = dict(loss="ppo", lr=1e-3, warmup_steps=1, precision="bf16", grad_checkpointing="on")
    got = spawn_steps(tmp_path, tiny_model_dir, samples, adv, kw)
    fp32 = Trainer(str(tiny_model_dir), TrainConfig()).probe_logprobs(list(range(2, 20)))
    assert got["start"]["dtypes"] == ["torch.float32"] and got["grads"] == ["torch.float32"]
    assert 1e-4 < max(abs(a - b) for a, b in zip(got["start"]["probe"], fp32)) < 0.25
    single = Trainer(str(tiny_model_dir), TrainConfig(**kw))
    start = dict(single.full_state())
    single.train_step(samples, adv)
    ref = dict(single.full_state())
    moved = [(got["end"][k] - start[k]).abs().max().item() for k in ref]
    assert max(moved) > 5e-4                                                   # it trained
    # at most a sign flip of one Adam step (2 lr) where bf16 rounding turns a tiny gradient around
    assert max((got["end"][k] - ref[k]).abs().max().item() for k in ref) <= 2e-3 + 1e-6


def grads_of_one_step(tr, samples, adv):
    """The gradients the optimizer step sees (the step itself is skipped)."""
    seen = {}

    def capture():
        seen.update({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})
    tr.opt.step = capture
    tr.train_step(samples, adv)
    return seen


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_the_same_gradient(tiny_model_dir, agg):
    """--max-tokens-per-micro packs samples of different lengths by tokens (here 3 micro-batches of up to 40
    token slots): the gradient equals one sample per micro-batch, within 1e-6 (its largest entry is ~0.07;
    float32 batching alone puts 3e-7 between them: --micro-batch 8 is as far), and the packed micro-batches
    hold fewer padding slots than one micro-batch of all 8."""
    from model import pack_by_tokens
    from tools.bench_trainer import padded_share
    samples = []
    for i, n in enumerate([3, 11, 5, 8, 2, 9, 14, 4]):
        samples += make_samples(tiny_model_dir, n=1, resp_len=n, seed=i)
    adv = [1.0, -1.0, 0.5, -0.5, 1.0, -0.3, 0.2, -1.0]
    one = grads_of_one_step(Trainer(str(tiny_model_dir), TrainConfig(loss_agg=agg, micro_batch=1)), samples,
                            adv)
    packed_tr = Trainer(str(tiny_model_dir), TrainConfig(loss_agg=agg, max_tokens_per_micro=40))
    packed = grads_of_one_step(packed_tr, samples, adv)
    assert set(packed) == set(one) and max((packed[n] - one[n]).abs().max().item() for n in one) < 1e-6
    lengths = [s.num_tokens for s in samples]
    parts = pack_by_tokens(lengths, 40)
    assert len(parts) == 3 and len(packed_tr._plan(samples, adv, None)[0]) == 3
    assert padded_share(parts, lengths) < padded_share([list(range(8))], lengths)


def test_trainer_logprobs_are_of_the_sampling_temperature(tiny_model_dir):
    """--temperature 0.7: the policy's, pi_prox's and the reference's log-probs (and the entropy) are of
    softmax(logits / 0.7), computed here from transformers' logits; samples whose behaviour log-probs are
    of that distribution (what the engine reports) are then on-policy in train_step (ratio 1, KL 0). The
    weight-sync probe stays at temperature 1, as the engines score it."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    T = 0.7
    raw = make_samples(tiny_model_dir, n=4)
    t = collate(raw, "cpu")
    with torch.no_grad():
        logits = hf(input_ids=t["input_ids"]).logits[:, :-1] / T                     # [B, L-1, V]
    logp_T = logits.log_softmax(-1).gather(-1, t["input_ids"][:, 1:, None])[..., 0]  # [B, L-1]
    want = torch.cat([torch.zeros(len(raw), 1), logp_T], 1) * t["mask"]              # [B, L], 0 off the mask
    ent_T = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)[t["mask"][:, 1:] != 0]     # [N]
    assert (want - t["old_logp"] * t["mask"]).abs().max() > 0.05       # T = 0.7 is far from T = 1's
    tr = Trainer(str(tiny_model_dir), TrainConfig(loss="decoupled_ppo", kl_coef=0.1), temperature=T)
    entropy = []
    with torch.no_grad():
        torch.testing.assert_close(tr.logprobs(t, entropy), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(tr.ref_logprobs(t), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[0], ent_T, atol=1e-5, rtol=1e-5)
    probe = list(range(2, 20))
    assert tr.probe_logprobs(probe) == Trainer(str(tiny_model_dir), TrainConfig()).probe_logprobs(probe)
    tempered = [dataclasses.replace(s, logprobs=want[i, len(s.prompt_ids):s.num_tokens].tolist())
                for i, s in enumerate(raw)]
    on = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo"), temperature=T)
    m = on.train_step(tempered, [1.0, -1.0] * 2)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["approx_kl"] < 1e-9
    with pytest.raises(ValueError, match="--temperature"):
        Trainer(str(tiny_model_dir), TrainConfig(), temperature=0.0)


def test_gspo_trains_per_sequence_by_default(tiny_model_dir):
    """--loss gspo without --loss-agg: its paper's mean over sequences (seq-mean-token-mean), not the token
    mean the other losses default to; --loss-agg token-mean still gives that."""
    samples = [s for i, n in enumerate([2, 11, 4, 7])
               for s in make_samples(tiny_model_dir, n=1, resp_len=n, seed=i)]
    adv = [1.0, -1.0, 0.5, -0.5]

    def grads(**kw):
        return grads_of_one_step(Trainer(str(tiny_model_dir), TrainConfig(loss="gspo", **kw)), samples, adv)
    default, per_seq, per_token = grads(), grads(loss_agg="seq-mean-token-mean"), grads(loss_agg="token-mean")
    assert all(torch.equal(default[n], per_seq[n]) for n in per_seq)
    assert max((per_token[n] - per_seq[n]).abs().max().item() for n in per_seq) > 1e-3


def test_fsdp_ranks_with_different_token_loads_run_the_same_passes(tiny_model_dir, tmp_path):
    """Packed by tokens, rank 0's long samples need 3 micro-batches and rank 1's short ones 1: rank 1 runs 2
    empty ones, so both run every collective (no hang), and they end with the same weights."""
    long = [s for i in range(3) for s in make_samples(tiny_model_dir, n=1, resp_len=20, seed=i)]
    short = [s for i in range(3) for s in make_samples(tiny_model_dir, n=1, resp_len=2, seed=10 + i)]
    samples = [x for pair in zip(long, short) for x in pair]          # rank 0 gets samples[0::2]: the long
    adv = [1.0, -1.0] * 3
    got = spawn_steps(tmp_path, tiny_model_dir, samples, adv,
                      dict(loss="ppo", lr=1e-3, max_tokens_per_micro=30))
    assert got["metrics"][0]["num_updates"] == 1 and got["metrics"][0]["grad_norm"] > 0


def test_kl_to_the_reference_is_off_by_default_and_pulls_back_when_on(tiny_model_dir):
    """--kl-coef 0 loads no reference. On: the reference is the initial model, frozen (kl 0 before any update,
    > 0 after); without the penalty the policy keeps drifting from it, with a large one it comes back."""
    samples = make_samples(tiny_model_dir, n=4)
    adv = [1.0, -1.0, 1.0, -1.0]
    assert Trainer(str(tiny_model_dir), TrainConfig()).ref_net is None
    free = Trainer(str(tiny_model_dir), TrainConfig(lr=3e-3, warmup_steps=1, kl_coef=1e-9))
    tied = Trainer(str(tiny_model_dir), TrainConfig(lr=3e-3, warmup_steps=1, kl_coef=10.0))
    assert tied.ref_net is not None and not any(p.requires_grad for p in tied.ref_net.parameters())
    # (10 steps: on this model the tied run is at 0.82x its first kl after 6, 0.49x after 10)
    kl = [[tr.train_step(samples, adv)["kl"] for _ in range(10)] for tr in (free, tied)]
    assert kl[0][0] == kl[1][0] == 0.0 and kl[0][1] == kl[1][1] > 0     # the same first update (no kl yet)
    assert kl[0][-1] > kl[0][1] and kl[1][-1] < 0.8 * kl[1][1]


def test_kl_reference_under_lora_is_the_base_with_the_adapter_off(tiny_model_dir, tmp_path):
    """One rank and two FSDP ranks alike: kl 0 while the adapter is B = 0, > 0 once it trained."""
    from ext.lora import LoraConfig, lora_weights
    samples = make_samples(tiny_model_dir, n=4)
    kw = dict(lr=1e-2, warmup_steps=0, kl_coef=0.1)
    tr = Trainer(str(tiny_model_dir), TrainConfig(**kw), weights=lora_weights(LoraConfig(lora_rank=8)))
    assert tr.ref_net is None                      # no copy: the base is the reference
    assert tr.train_step(samples, [1.0, -1.0, 1.0, -1.0])["kl"] == 0.0        # B = 0: the adapter is the base
    assert tr.train_step(samples, [1.0, -1.0, 1.0, -1.0])["kl"] > 0
    got = spawn_steps(tmp_path, tiny_model_dir, samples, [1.0, -1.0, 1.0, -1.0], kw, steps=2, lora_rank=8)
    assert got["metrics"][0]["kl"] == 0.0 and got["metrics"][1]["kl"] > 0


def test_fsdp_with_a_sharded_reference_matches_one_process(tiny_model_dir, tmp_path):
    """KL to a sharded reference over 2 FSDP ranks: the same weights after 2 steps as one process."""
    samples = make_samples(tiny_model_dir)
    adv = [1.0, -1.0, 0.5, -0.5]
    kw = dict(loss="ppo", lr=1e-3, kl_coef=0.5)
    single = Trainer(str(tiny_model_dir), TrainConfig(**kw))
    for _ in range(2):
        m = single.train_step(samples, adv)
    ref = dict(single.full_state())
    got = spawn_steps(tmp_path, tiny_model_dir, samples, adv, kw, steps=2)
    assert m["kl"] > 0 and got["metrics"][1]["kl"] > 0
    assert max((got["end"][k] - ref[k]).abs().max().item() for k in ref) < 1e-5


def test_entropy_is_the_policys_mean_over_response_tokens(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    samples = make_samples(tiny_model_dir, n=4)
    t = collate(samples, "cpu")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=t["input_ids"], attention_mask=t["attn"]).logits, -1)
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]                      # [B, T-1]: position p-1 predicts token p
    want = (ent * t["mask"][:, 1:]).sum() / t["mask"].sum()
    got = Trainer(str(tiny_model_dir), TrainConfig()).train_step(samples, [1.0, -1.0, 1.0, -1.0])["entropy"]
    assert got == pytest.approx(want.item(), rel=1e-5)


def test_grad_checkpointing_recomputes_to_the_same_gradient(tiny_model_dir):
    samples = make_samples(tiny_model_dir)
    adv = [1.0, -1.0, 1.0, -1.0]
    off = grads_of_one_step(Trainer(str(tiny_model_dir), TrainConfig()), samples, adv)
    tr = Trainer(str(tiny_model_dir), TrainConfig(grad_checkpointing="on"))
    assert tr.model.is_gradient_checkpointing
    on = grads_of_one_step(tr, samples, adv)
    assert max((on[n] - off[n]).abs().max().item() for n in off) < 1e-6


@pytest.mark.parametrize("kw, flag", [(dict(precision="fp16"), "--precision"),
                                      (dict(grad_checkpointing="yes"), "--grad-checkpointing"),
                                      (dict(max_tokens_per_micro=-1), "--max-tokens-per-micro"),
                                      (dict(logits_chunk=0), "--logits-chunk"),
                                      (dict(kl_coef=-1.0), "--kl-coef")])
@pytest.mark.fast
def test_bad_scale_settings_name_their_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        TrainConfig(**kw)


@pytest.mark.fast
def test_auto_settings_follow_the_device():
    assert (TrainConfig().resolved("cpu").precision, TrainConfig().resolved("cpu").grad_checkpointing) == \
        ("fp32", "off")
    assert (TrainConfig().resolved("cuda").precision, TrainConfig().resolved("cuda").grad_checkpointing) == \
        ("bf16", "on")
    assert TrainConfig(precision="fp32").resolved("cuda").precision == "fp32"


@pytest.mark.fast
def test_probe_diff_is_judged_at_the_runs_precision():
    import dataclasses

    from runlog import probe_verdict
    from train import Config
    cfg = Config()
    bf16 = dataclasses.replace(cfg, train=TrainConfig(precision="bf16"))
    assert "within fp32" in probe_verdict(5e-6, cfg) and "ABOVE fp32" in probe_verdict(0.02, cfg)
    assert "within bf16" in probe_verdict(0.02, bf16)
    engine_bf16 = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, dtype="bfloat16"))
    assert "within bf16" in probe_verdict(0.02, engine_bf16)


# ---------------------------------------------------------------------------------------------
# per-token fields: a token's version, its lag and each Sample.token_fields entry reach the loss


def field_samples():
    """A two-turn sample (an observation between its turns: a hole in the loss mask) and a one-turn one,
    with versions and a teacher's per-token log-probs (one value per model token)."""
    two = Sample("two", "g0", [3, 4, 5], [6, 7, 8, 9, 10, 11], [-0.5] * 6, [1, 1, 0, 0, 1, 1], [5, 5, 7, 7],
                 1.0, token_fields={"teacher_logp": [-0.1, -0.2, -0.3, -0.4]})
    one = Sample("one", "g0", [3], [12, 13], [-0.7, -0.9], [1, 1], [6, 8], 0.0,
                 token_fields={"teacher_logp": [-1.0, -2.0]})
    return [two, one]


# each on the loss mask's columns (the two-turn sample's model tokens are at 3, 4, 7, 8), 0 elsewhere; lag
# behind trainer version 8
WANT = {"version": [[0, 0, 0, 5, 5, 0, 0, 7, 7], [0, 6, 8, 0, 0, 0, 0, 0, 0]],
        "lag": [[0, 0, 0, 3, 3, 0, 0, 1, 1], [0, 2, 0, 0, 0, 0, 0, 0, 0]],
        "teacher_logp": [[0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4], [0, -1.0, -2.0, 0, 0, 0, 0, 0, 0]]}


@pytest.mark.fast
def test_collate_puts_each_tokens_version_lag_and_fields_on_the_mask_columns():
    t = collate(field_samples(), "cpu", version=8)
    assert t["mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert set(t["fields"]) == set(WANT)
    for name, want in WANT.items():
        torch.testing.assert_close(t["fields"][name], torch.tensor(want, dtype=torch.float32))
    assert "lag" not in collate(field_samples(), "cpu")["fields"]          # no trainer version: no lag


@pytest.mark.fast
def test_a_sample_without_a_field_its_micro_batch_has_is_named():
    two, one = field_samples()
    one.token_fields = {}
    with pytest.raises(ValueError, match="sample one: per-token field 'teacher_logp' missing"):
        collate([two, one], "cpu")
    one.token_fields = {"teacher_logp": [-1.0, -2.0, -3.0]}
    with pytest.raises(ValueError, match="'teacher_logp' has 3 values for its 2 model tokens"):
        collate([two, one], "cpu")
    one.token_fields = {"lag": [1.0, 1.0]}
    with pytest.raises(ValueError, match="'lag' are the core's own"):
        collate([one], "cpu")


@pytest.fixture
def recorded(monkeypatch):
    """--loss record: REINFORCE that keeps each micro-batch's Terms (a loss registered outside losses.py)."""
    import losses
    seen = []

    @losses.loss()
    def record(t):
        seen.append(t)
        return -t.A * t.lp, {}
    monkeypatch.setitem(losses.LOSSES, "record", record)
    return seen


def test_version_lag_and_fields_reach_the_loss_whole_batch_streamed_and_on_padding(tiny_model_dir, recorded):
    """The loss sees each token's version, lag and teacher_logp on the mask's columns: train_step (one
    micro-batch of both samples), the streamed GradStream (one sample a micro-batch) and an empty one (the
    FSDP padding: no samples, so no sample's field names; any reads as zeros)."""
    from ext.stream_trainer import GradStream
    seen = recorded
    samples = field_samples()
    tr = Trainer(str(tiny_model_dir), TrainConfig(loss="record", lr=1e-3))
    tr.train_step(samples, [1.0, -1.0], version=8)
    [t] = seen
    for name, want in WANT.items():
        torch.testing.assert_close(t.fields[name], torch.tensor(want, dtype=torch.float32))
    assert torch.equal(t.version, t.fields["version"]) and torch.equal(t.lag, t.fields["lag"])
    seen.clear()
    grad = GradStream(tr)
    grad.begin(8)
    for i, s in enumerate(samples):
        grad.micro([s], [1.0])
        for name, want in WANT.items():        # its own micro-batch: as wide as the sample
            row = torch.tensor([want[i][:s.num_tokens]], dtype=torch.float32)
            torch.testing.assert_close(seen[-1].fields[name], row)
    grad.micro([], [])                                                  # the padding
    assert seen[-1].fields["teacher_logp"].tolist() == [[0.0, 0.0]] == seen[-1].lag.tolist()   # (EMPTY's 2)
    assert grad.step()["grad_norm"] > 0
    tr.forward_backward(tr.micro(samples[:1], [1.0], None), 1.0, {})      # no trainer version: no lag
    with pytest.raises(KeyError, match="no per-token field 'lag' in this batch .it has version, teacher"):
        seen[-1].lag


def test_an_advantage_shaper_makes_per_token_advantages(tiny_model_dir, recorded, monkeypatch):
    """losses.ADV_SHAPERS, on-policy distillation's A_t = A + coef (teacher_logp_t - old_logp_t) registered
    from outside losses.py: its flag parses through train.py's Config, and the advantages the loss sees are
    its own, per token, whole batch and streamed; the padding runs through it too."""
    import losses
    from config import parse_cli
    from ext.stream_trainer import GradStream
    from train import Config

    @dataclasses.dataclass
    class DistillParams:
        distill_coef: float = losses.opt(0.5, "distill: the teacher's log-prob over the sample's, times this")

    @losses.loss(hparams=DistillParams)
    def distill(t, p):
        return t["adv"][:, None] + p.distill_coef * (t["fields"]["teacher_logp"] - t["old_logp"]) * t["mask"]
    monkeypatch.setitem(losses.ADV_SHAPERS, "distill", distill)
    assert parse_cli(Config, ["--distill-coef", "0.3"]).train.hparams["distill"].distill_coef == 0.3
    samples = field_samples()
    tr = Trainer(str(tiny_model_dir), TrainConfig(loss="record", lr=1e-3))
    t = collate(samples, "cpu")
    teacher = torch.tensor(WANT["teacher_logp"], dtype=torch.float32)
    want = torch.where(t["mask"] != 0, torch.tensor([[1.0], [-1.0]]) + 0.5 * (teacher - t["old_logp"]), 0.0)
    tr.train_step(samples, [1.0, -1.0], version=8)
    torch.testing.assert_close(recorded[-1].A, want)
    grad = GradStream(tr)
    grad.begin(8)
    grad.micro(samples[1:], [-1.0])
    torch.testing.assert_close(recorded[-1].A, want[1:, :3])
    grad.micro([], [])
    assert recorded[-1].A.tolist() == [[0.0, 0.0]]
    grad.step()
