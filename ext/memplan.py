"""ext/memplan.py: how much memory each trainer rank and each engine will need, from the model's HF config
and the run's flags, before anything starts (rank 0 prints it at start-up; --dry-run prints it and exits
before any process group or engine starts, no torchrun needed).

    counts = param_counts(hf_config)                  # built on the meta device: nothing is allocated
    plan = make_plan(hf_config, cfg, gpu=True)        # cfg: train.py's Config (its train / rollout parts)
    print(format_plan(plan))

Per trainer rank (W ranks, FSDP2): float32 master weights, gradients and AdamW's two moments, each a
1/W shard (LoRA: gradients and moments of the adapter only); under FSDP the gathered weights in use
(the root's embeddings and head all step long, plus two decoder layers: the one computing and the
prefetched one); activations at the micro-batch's token budget; one chunk of LM-head logits; --kl-coef's
reference model (a 1/W shard, bfloat16 under --precision bf16); under --colocate, the weight sync's
(sync_bytes: the ipc buffers at the largest bucket, the weight in hand). Per engine: the weights in the
engine's dtype and the KV cache (--kv-cache-gib on CPU; on GPU --gpu-memory-utilization of the GPU, less
the weights). Activation bytes per token per layer are counted from what a Qwen2/Llama decoder layer keeps
for backward (act_bytes); checked against measured peaks by tools/bench_trainer.py memplan.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

from config import Extension, extension, opt

GiB = 1 << 30
ASSUMED_GPU_GIB = 80.0        # a GPU's memory when none is here to ask (H100 / A100 80 GB)
LOGIT_COPIES = 3              # [chunk, V] float32 blocks alive at once in the head (bench_trainer logprobs)
# the ipc transport's bucket buffers per sender (ext/colocate.py's IpcSender): one filled while the worker
# copies the other. Here, not there: the plan counts them and colocate.py imports this module (no circle)
BUFFERS = 2


def param_counts(hf_config, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> dict:
    """Parameter counts of the model that hf_config describes, from an instance on the meta device:
    total, layer (one decoder layer), root (what is not in a decoder layer: embeddings, final norm,
    an untied head), adapter (LoRA: rank x (in + out) per targeted linear); sent: the shapes of what a
    weight sync sends, in its order (trainer.named_weights: a tied head left out; LoRA: the adapter's A
    [rank, in] and B [out, rank] per targeted linear)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    total = sum(p.numel() for p in model.parameters())        # (a tied head is the embedding: counted once)
    layers = model.model.layers
    layer = sum(p.numel() for p in layers[0].parameters())
    targeted = [m for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in lora_targets]
    adapter = sum(lora_rank * (m.in_features + m.out_features) for m in targeted)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    sent = ([s for m in targeted for s in ([lora_rank, m.in_features], [m.out_features, lora_rank])]
            if lora_rank else [list(t.shape) for n, t in model.state_dict().items()
                               if not (tied and n == "lm_head.weight")])
    return {"total": total, "layer": layer, "num_layers": len(layers), "root": total - layer * len(layers),
            "adapter": adapter, "sent": sent}


def sync_bytes(counts: dict, dtype: str, bucket_bytes: int, buffers: int) -> int:
    """Bytes a trainer rank holds for a weight sync: `buffers` flat bucket buffers, kept between syncs, each
    the size of the largest bucket (weight_sync.plan_buckets: a bucket never splits a tensor, so it is at
    least the largest weight: Qwen2.5-7B's embedding, 1.09 GB in bf16, against 64 MiB buckets), and the one
    weight gathered at a time, in the engine's dtype."""
    import torch

    from weight_sync import layout_bytes, plan_buckets
    layout = [("", shape, dtype) for shape in counts["sent"]]
    buckets = [layout_bytes([layout[i] for i in idx]) for idx in plan_buckets(layout, bucket_bytes)]
    largest = max(torch.Size(shape).numel() for shape in counts["sent"]) * getattr(torch, dtype).itemsize
    return buffers * max(buckets) + largest


def act_bytes(hf_config, compute: int) -> int:
    """Bytes one decoder layer keeps for backward, per token, computing in `compute`-byte floats (counted
    with torch.autograd.graph.saved_tensors_hooks on Qwen2; SDPA attention, so no attention matrix). Each
    RMSNorm: its input as float32 (4H), its normalised input and its output (2 x compute x H); q, k, v and
    the attention output for SDPA's backward (4H: a padded micro-batch has a mask, so HF repeats GQA's keys
    and values to every head), that output again made contiguous for o_proj (H; CPU's kernel returns it in
    that layout already); the MLP's gate, up, silu(gate) and their product (4I)."""
    h, i = hf_config.hidden_size, hf_config.intermediate_size
    return 2 * (4 + 2 * compute) * h + compute * (5 * h + 4 * i)


@dataclass
class Plan:
    model: str
    counts: dict
    trainer: dict          # name -> bytes, per trainer rank
    engine: dict           # name -> bytes, per engine
    notes: dict            # what the figures assume


def trainer_bytes(counts: dict, hf_config, ranks: int, bf16: bool, tokens: int, context: int,
                  checkpointing: bool, chunk: int, kl: bool, lora: bool) -> dict:
    """Bytes per trainer rank, by component (see the module docstring)."""
    w, total, layer = ranks, counts["total"], counts["layer"]
    trainable = counts["adapter"] if lora else total
    compute = 2 if bf16 else 4                                    # bytes of a weight / activation in compute
    out = {"weights (fp32 masters)": 4 * total / w, "gradients": 4 * trainable / w,
           "AdamW moments": 8 * trainable / w}
    if w > 1:          # FSDP: what is gathered while in use
        out["gathered weights"] = compute * (counts["root"] + 2 * layer)
    if kl and not lora:
        out["reference model"] = compute * total / w
    h, n, layer_act = hf_config.hidden_size, counts["num_layers"], act_bytes(hf_config, compute)
    # checkpointing keeps each layer's input and recomputes one layer at a time in backward; outside the
    # layers: the final norm and the selected hidden states; the attention mask, rows x longest^2
    per_token = (n * h * compute + layer_act if checkpointing else n * layer_act) + (4 + 3 * compute) * h
    out["activations"] = tokens * per_token + tokens * min(tokens, context) * compute
    out["logits chunk"] = LOGIT_COPIES * min(chunk, tokens) * hf_config.vocab_size * 4
    return out


def engine_bytes(counts: dict, hf_config, dtype: str, gpu: bool, utilisation: float, kv_cache_gib: float,
                 gpu_gib: float) -> dict:
    """Bytes per engine: its weights in its dtype and its KV cache."""
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    weights = size * counts["total"]
    kv = utilisation * gpu_gib * GiB - weights if gpu else kv_cache_gib * GiB
    return {"weights": weights, "KV cache": max(kv, 0.0)}


COLOCATE_MARGIN = 2 * GiB     # --colocate: CUDA contexts and the allocators' slack of two processes
COLOCATE_MAX_SHARE = 0.9


def colocated_headroom(trainer: dict, bucket_bytes: int) -> float:
    """--colocate: what the trainer rank on an engine's GPU adds after the engine has started (it builds
    its model first) and holds while the engine is awake: gradients and AdamW moments (kept between
    steps), the weights FSDP gathered, a sync's (the plan's "weight sync": the ipc buffers at the largest
    bucket and the weight in hand; a plan without it: BUFFERS buckets of bucket_bytes), and a margin.
    Activations are not in it: the engine sleeps while the trainer trains."""
    kept = ("gradients", "AdamW moments", "gathered weights")
    return (sum(trainer.get(k, 0.0) for k in kept) + trainer.get("weight sync", BUFFERS * bucket_bytes)
            + COLOCATE_MARGIN)


def colocated_share(total: float, free: float, headroom: float, weights: float) -> float:
    """--colocate's default --gpu-memory-utilization: what is free at the engine's start less the
    trainer's headroom, as a share of the GPU (vLLM refuses a share above what is free at its start),
    at most COLOCATE_MAX_SHARE. A share that leaves the engine no room for its weights and a GiB of KV
    cache is an error."""
    share = min((free - headroom) / total, COLOCATE_MAX_SHARE)
    if share * total < weights + GiB:
        raise ValueError(f"--colocate: {free / GiB:.1f} GiB free of {total / GiB:.1f} at the engine's start, "
                         f"less the trainer's {headroom / GiB:.1f} GiB headroom, leaves the engine "
                         f"{max(share, 0) * total / GiB:.1f} GiB for its {weights / GiB:.1f} GiB of weights "
                         f"and a KV cache; set --gpu-memory-utilization yourself, or train on more GPUs")
    return round(share, 3)


def kv_bytes_per_token(hf_config, dtype: str) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * size


def make_plan(hf_config, cfg, gpu: bool, model: str = "", gpu_gib: float | None = None) -> Plan:
    """The plan for train.py's Config `cfg` (its train, rollout and lora parts; the rollout part resolved
    or not) on GPUs (gpu) or CPUs. Micro-batch token budget: --max-tokens-per-micro, else --micro-batch
    rows of the engine's whole context (the largest a padded micro-batch can be)."""
    tc, rc = cfg.train.resolved("cuda" if gpu else "cpu"), cfg.rollout
    context = rc.max_model_len or hf_config.max_position_embeddings
    tokens = tc.max_tokens_per_micro or tc.micro_batch * context
    dtype = rc.dtype if rc.dtype != "auto" else ("bfloat16" if gpu else "float32")
    lora_cfg, colocate = cfg.ext["lora"], cfg.ext["colocate"].colocate
    lora = lora_cfg.lora_rank > 0
    counts = param_counts(hf_config, lora_cfg.lora_rank, tuple(lora_cfg.targets))
    gpu_gib = gpu_gib or ASSUMED_GPU_GIB
    trainer = trainer_bytes(counts, hf_config, cfg.train_gpus, tc.precision == "bf16", tokens, context,
                            tc.grad_checkpointing == "on", tc.logits_chunk, tc.kl_coef > 0, lora)
    if colocate:      # held while the engine on the same GPU is awake
        trainer["weight sync"] = sync_bytes(counts, dtype, cfg.bucket_mb << 20, BUFFERS)
    share = rc.gpu_memory_utilization or 0.85
    if gpu and colocate and not rc.gpu_memory_utilization:   # as ext/colocate.py picks it
        weights = engine_bytes(counts, hf_config, dtype, gpu, 0.0, 0.0, gpu_gib)["weights"]
        free = gpu_gib * GiB - sum(v for k, v in trainer.items() if k in ("weights (fp32 masters)",
                                                                           "reference model"))
        headroom = colocated_headroom(trainer, cfg.bucket_mb << 20)
        share = colocated_share(gpu_gib * GiB, free, headroom, weights)
    engine = engine_bytes(counts, hf_config, dtype, gpu, share, rc.kv_cache_gib, gpu_gib)
    notes = {"ranks": cfg.train_gpus, "engines": cfg.rollout_gpus, "precision": tc.precision,
             "checkpointing": tc.grad_checkpointing, "tokens": tokens, "context": context, "dtype": dtype,
             "gpu": gpu, "gpu_gib": gpu_gib, "kv_per_token": kv_bytes_per_token(hf_config, dtype),
             "lora": lora}
    return Plan(model, counts, trainer, engine, notes)


def _size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB / 4 else f"{b / 2**20:.1f} MiB"


def format_plan(p: Plan) -> str:
    """A few lines: the model; each trainer rank's total, then its components; each engine's."""
    import textwrap
    n = p.notes
    where = f"{n['gpu_gib']:.0f} GiB GPUs" if n["gpu"] else "CPU"
    kv_tokens = p.engine["KV cache"] / n["kv_per_token"]
    parts = " + ".join(f"{k} {_size(v)}" for k, v in p.trainer.items())
    return "\n".join([
        f"memory plan (ext/memplan.py, {where}): {p.model or 'model'} {p.counts['total'] / 1e6:,.1f}M params"
        + (f" (LoRA adapter {p.counts['adapter'] / 1e6:,.2f}M)" if n["lora"] else ""),
        f"  per trainer rank ({n['ranks']}, {n['precision']}, checkpointing {n['checkpointing']}, "
        f"{n['tokens']:,} tokens a micro-batch): {_size(sum(p.trainer.values()))} =",
        textwrap.fill(parts, 104, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False),
        f"  per engine ({n['engines']}, {n['dtype']}): {_size(sum(p.engine.values()))} = weights "
        f"{_size(p.engine['weights'])} + KV cache {_size(p.engine['KV cache'])}",
        f"    (KV: {kv_tokens:,.0f} tokens, {kv_tokens / n['context']:,.1f} sequences of {n['context']:,})"])


def memory_plan(cfg, model_dir: str, gpu: bool) -> str:
    """The plan for this model (model_dir's config; none: the embedded one's) and layout."""
    import torch
    from transformers import AutoConfig

    import tiny_model
    hf = AutoConfig.from_pretrained(model_dir) if model_dir else tiny_model.hf_config(tiny_model.TinyConfig())
    gib = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
           if gpu and torch.cuda.is_available() else None)
    name = Path(model_dir).name or "the embedded model"
    return format_plan(make_plan(hf, cfg, gpu, name, gib))


@dataclass
class MemplanConfig:
    dry_run: str = opt("", "print the memory plan (ext/memplan.py) for --model and the layout given, then "
                           "exit before any process group or engine starts (no torchrun needed): gpu | cpu | "
                           "auto (--dry-run alone: this machine's)", const="auto")

    def __post_init__(self):
        if self.dry_run not in ("", "gpu", "cpu", "auto"):
            raise ValueError(f"--dry-run must be gpu, cpu or auto (alone: auto), got {self.dry_run!r}")


@extension
class MemoryPlan(Extension):
    name, Config = "memplan", MemplanConfig
    order = -1          # --dry-run answers before any other extension's launch checks

    def before_launch(self):
        """--dry-run: the memory plan, then nothing else."""
        if not self.part.dry_run:
            return
        import torch
        model = self.cfg.model
        if model and not (Path(model) / "config.json").exists():
            sys.exit(f"train.py: --model {model}: no config.json (a Hugging Face model dir)")
        gpu = self.part.dry_run == "gpu" or (self.part.dry_run == "auto" and torch.cuda.is_available())
        try:
            print(memory_plan(self.cfg, model, gpu))
        except ValueError as e:                 # (--colocate: no room left for the engine)
            sys.exit(f"train.py: {e}")
        sys.exit(0)

    def startup_lines(self, model_dir: str, device: str):
        if self.cfg.weight_transport == "inprocess":      # (one process: its engine is not vLLM, no plan)
            return None
        return memory_plan(self.cfg, model_dir, device.startswith("cuda"))
