"""memplan.py: parameter counts from the layout device, the plan's arithmetic, and train.py --dry-run (the
plan, then an exit before any process group or engine; a Qwen2.5-7B config, nothing downloaded). The plan
against measured peaks: tools/bench_trainer.py memplan."""

import subprocess
import sys
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


def test_dry_run_prints_the_plan_without_torchrun():
    """train.py --dry-run: no torchrun environment, no engine, no process group: the plan and exit 0 (the
    Qwen2.5-7B config at the README's 24 + 16 layout; and the embedded model, which need not be built); a bad
    --model or --dry-run value is refused naming its flag. (The four runs two at a time.)"""
    import concurrent.futures
    bad = [(["--dry-run", "--model", str(ROOT / "nowhere")], "--model"), (["--dry-run", "tpu"], "--dry-run")]
    runs = [["--dry-run", "gpu", "--model", str(QWEN_7B), "--rollout-gpus", "24", "--train-gpus", "16",
             "--max-tokens-per-micro", "16384"], ["--dry-run", "cpu"], *(args for args, _ in bad)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda args: subprocess.run([sys.executable, "train.py", *args], cwd=ROOT,
                                                         capture_output=True, text=True, timeout=300), runs))
    r = done[0]
    assert r.returncode == 0, r.stderr[-2000:]
    assert "7,615.6M params" in r.stdout and "per trainer rank (16, bf16" in r.stdout
    assert "per engine (24, bfloat16)" in r.stdout and "RANK" not in r.stdout + r.stderr
    r = done[1]
    assert r.returncode == 0 and "the embedded model 1.1M params" in r.stdout, r.stderr[-2000:]
    for r, (_, flag) in zip(done[2:], bad):
        assert r.returncode != 0 and flag in r.stderr
