"""memplan.py: parameter counts from the layout device and the plan's arithmetic (a Qwen2.5-7B config,
nothing downloaded). train.py --dry-run (the plan, then an exit before any process group or engine): in
tests/test_reliability.py's batch of train.py runs. The plan against measured peaks: tools/bench_trainer.py
memplan."""

from pathlib import Path

import pytest

from ext import memplan

ROOT = Path(__file__).resolve().parent.parent
QWEN_7B = ROOT / "tools" / "qwen2.5-7b"          # Qwen2.5-7B's public config.json, no weights


def test_counts_from_the_meta_device_are_the_models(tiny_model_dir):
    """The tiny model's real parameter count and LoRA adapter size, and Qwen2.5-7B's published 7,615,616,512
    (untied head: the root holds embeddings and head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ext import lora
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    wrapped = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora.LoraConfig(lora_rank=8))
    counts = memplan.param_counts(model.config, 8, tuple(lora.LoraConfig(lora_rank=8).targets))
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["adapter"] == sum(p.numel() for n, p in wrapped.named_parameters() if p.requires_grad)
    assert counts["layer"] == sum(p.numel() for p in model.model.layers[0].parameters())
    big = memplan.param_counts(AutoConfig.from_pretrained(QWEN_7B))
    assert big["total"] == 7_615_616_512 and big["num_layers"] == 28
    assert big["root"] == 2 * 152_064 * 3584 + 3584                 # embeddings, head, final norm


def test_the_plans_arithmetic_for_7b_on_16_trainer_ranks():
    import dataclasses

    from transformers import AutoConfig

    from train import Config
    cfg = Config(train_gpus=16, rollout_gpus=24)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_tokens_per_micro=16384))
    plan = memplan.make_plan(AutoConfig.from_pretrained(QWEN_7B), cfg, gpu=True)
    p, t, e = 7_615_616_512, plan.trainer, plan.engine
    assert plan.notes["precision"] == "bf16" and plan.notes["checkpointing"] == "on"
    assert t["weights (fp32 masters)"] == 4 * p / 16 and t["gradients"] == 4 * p / 16
    assert t["AdamW moments"] == 8 * p / 16
    assert t["gathered weights"] == 2 * (plan.counts["root"] + 2 * plan.counts["layer"])
    assert "reference model" not in t                                # --kl-coef 0: none
    assert e["weights"] == 2 * p and e["KV cache"] == pytest.approx(0.85 * 80 * 2**30 - 2 * p)
    assert plan.notes["kv_per_token"] == 2 * 28 * 4 * 128 * 2        # K and V, 28 layers, 4 KV heads of 128
    kl = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, kl_coef=0.01))
    assert memplan.make_plan(AutoConfig.from_pretrained(QWEN_7B), kl, gpu=True).trainer["reference model"] \
        == 2 * p / 16


def test_colocated_headroom_holds_both_ipc_buffers_at_the_size_of_the_embedding():
    """--colocate at 7B: a bucket never splits a tensor, so each of the ipc sender's two buffers is the
    largest bucket, Qwen2.5-7B's embedding alone (1.09 GB in bf16, against 64 MiB buckets), and a sync holds
    one gathered weight besides (in the engine's dtype); the engine's share leaves the trainer all of it."""
    from transformers import AutoConfig

    from config import parse_cli
    from train import Config
    from weight_sync import plan_buckets
    cfg = parse_cli(Config, ["--train-gpus", "8", "--rollout-gpus", "8", "--colocate", "--async-ratio", "0"])
    hf = AutoConfig.from_pretrained(QWEN_7B)
    plan = memplan.make_plan(hf, cfg, gpu=True)
    embedding = 152_064 * 3584 * 2                                   # bytes, bfloat16
    assert embedding > cfg.bucket_mb << 20
    layout = [("", shape, "bfloat16") for shape in plan.counts["sent"]]
    assert len(layout) == 339 and [0] in plan_buckets(layout, cfg.bucket_mb << 20)    # the embedding: alone
    assert plan.trainer["weight sync"] == 2 * embedding + embedding  # 2 buffers + the weight in hand
    t = plan.trainer
    assert memplan.colocated_headroom(t, cfg.bucket_mb << 20) == (
        t["gradients"] + t["AdamW moments"] + t["gathered weights"] + 3 * embedding + memplan.COLOCATE_MARGIN)
    assert "weight sync" not in memplan.make_plan(hf, Config(train_gpus=8, rollout_gpus=8), gpu=True).trainer
