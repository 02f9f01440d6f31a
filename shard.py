"""shard.py: the trainer's model on its ranks. One rank: loaded whole. Several (FSDP2): no rank ever holds
the whole model: built on the meta device, sharded (each decoder layer, then the root), then each rank
reads only its own shards of the safetensors (torch.distributed.checkpoint's HF reader reads slices).

    model, net = build(model_dir, device="cuda:0", group=trainer_group, bf16=True, chunk=1024)
    set_adapter(model, adapter_dir, seed)          # LoRA: the saved adapter, or PEFT's init from a seed

bf16: FSDP2's MixedPrecisionPolicy (bfloat16 compute, float32 gradient reduce) over float32 master
weights; one rank autocasts instead. A frozen model (--kl-coef's reference) keeps only bfloat16 then.
`net` is microbatch.PolicyNet over the model: the FSDP root, the forward the trainer runs.
Design notes: DESIGN.md#trainerpy
"""

import math
from pathlib import Path

import torch
import torch.distributed as dist

import lora as lora_mod
from microbatch import PolicyNet, causal_lm


def build(model_dir: str, device, group=None, bf16: bool = False, chunk: int = 1024, lora=None,
          checkpointing: bool = False, frozen: bool = False):
    """(HF model, PolicyNet over it) on this rank; group: the trainer group when it has several ranks.
    lora: a LoraConfig to wrap the model with (its adapter still to be set: set_adapter). checkpointing:
    recompute each decoder layer in backward (transformers', non-reentrant). frozen: no gradients, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM
    device = torch.device(device)
    dtype = torch.bfloat16 if bf16 and frozen else torch.float32
    if group is not None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    if lora is not None:
        model = lora_mod.wrap(model, lora)
    if frozen:
        model.requires_grad_(False).eval()
    elif checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # one rank in bf16: autocast over float32 weights; under FSDP its mixed-precision policy casts
    net = PolicyNet(model, chunk, autocast=torch.bfloat16 if bf16 and group is None else None)
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        ranks = torch.tensor(dist.get_process_group_ranks(group))
        mesh = DeviceMesh.from_group(group, device.type, mesh=ranks)
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                  else MixedPrecisionPolicy())
        # (PEFT: the decoder layers are the wrapped model's; frozen base weights shard alike)
        for layer in causal_lm(model).model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(net, mesh=mesh, mp_policy=policy)       # the root: embeddings, final norm, head
        net.to_empty(device=device)                        # this rank's shards, still unset
        reset_buffers(model, device)
        read_own_shards(model, model_dir, group)
    return model, net


def set_adapter(model, adapter_dir: str, seed: int):
    """A LoRA model's adapter starting values, the same on one rank or many: the saved adapter (a
    --resume), else PEFT's init (A kaiming-uniform, B = 0) drawn from a generator seeded by `seed`. Under
    FSDP each rank keeps its own shard of each (small) full tensor."""
    from torch.distributed.tensor import distribute_tensor
    params = {n: p for n, p in model.named_parameters() if lora_mod.is_adapter_tensor(n)}
    if adapter_dir:
        from safetensors.torch import load_file
        path = Path(adapter_dir) / "adapter_model.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"{adapter_dir}: no adapter_model.safetensors (not a LoRA checkpoint)")
        saved, ours = load_file(str(path)), {lora_mod.adapter_name(n): n for n in params}
        if set(saved) != set(ours):
            raise ValueError(f"{path}: its tensors are not this model's adapter's (another --lora-targets?): "
                             f"{sorted(set(saved) ^ set(ours))[:3]}")
        full = {ours[k]: v for k, v in saved.items()}
    else:
        g, full = torch.Generator().manual_seed(seed), {}
        for n, p in params.items():
            full[n] = torch.zeros(p.shape)
            if ".lora_A." in n:
                torch.nn.init.kaiming_uniform_(full[n], a=math.sqrt(5), generator=g)
    with torch.no_grad():
        for n, t in full.items():
            p = params[n]
            t = t.to(p.device, p.dtype)
            if hasattr(p, "to_local"):       # src_data_rank None: every rank has t, none sends
                t = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(t)
            else:
                p.copy_(t)


def reset_buffers(model, device):
    """After to_empty: the non-persistent buffers (the rotary tables, computed at construction and never
    in a checkpoint) computed again, by constructing their module again. Any other module with such
    buffers is refused rather than left holding uninitialised memory."""
    for m in model.modules():
        if not m._non_persistent_buffers_set:
            continue
        if "RotaryEmbedding" not in type(m).__name__:
            raise NotImplementedError(f"{type(m).__name__}: non-persistent buffers (a sharded start cannot "
                                      f"recompute them): {m._non_persistent_buffers_set}")
        with torch.device(device):
            fresh = type(m)(config=m.config)
        for name, buf in fresh.named_buffers(recurse=False):
            getattr(m, name).copy_(buf)


def read_own_shards(model, model_dir: str, group):
    """Each rank reads only its own shards of model_dir's safetensors into `model`'s sharded weights
    (torch.distributed.checkpoint's HF reader reads slices; a checkpoint in bfloat16 is cast into the
    float32 masters). Names: PEFT's wrapped ones map back to the checkpoint's; a tied head is the
    embedding (one tensor), adapter tensors are not in the checkpoint."""
    import torch.distributed.checkpoint as dcp
    if not any(Path(model_dir).glob("*.safetensors")):
        raise ValueError(f"{model_dir}: --train-gpus > 1 reads each rank's shards from *.safetensors, and "
                         f"this dir has none (re-save it with save_pretrained(..., safe_serialization=True))")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    want = {}
    for name, t in model.state_dict().items():
        hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if not lora_mod.is_adapter_tensor(name) and not (tied and hf == "lm_head.weight"):
            want[hf] = t
    dcp.load(want, storage_reader=dcp.HuggingFaceStorageReader(model_dir), process_group=group)


