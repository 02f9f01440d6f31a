"""model.py: the trainer's model on its ranks, and what one micro-batch of it is.

    model, net = build(model_dir, device="cuda:0", trainer_group=trainer_group, bf16=True, chunk=1024)
    parts = pack_by_tokens([s.num_tokens for s in samples], budget=16384)   # index lists, longest first
    mb = collate([samples[i] for i in parts[0]], device, version)  # right-padded tensors; per-token fields
    logp = token_logprobs(net, mb["input_ids"], mb["attn"], mb["mask"])         # [B, T], 0 where unselected

The model: one rank loads it whole. Several (FSDP2): no rank ever holds the whole model: built on the
meta device, sharded (each decoder layer, then the root), then each rank reads only its own shards of
the safetensors (torch.distributed.checkpoint's HF reader reads slices). bf16: FSDP2's
MixedPrecisionPolicy (bfloat16 compute, float32 gradient reduce) over float32 master weights; one rank
autocasts instead. A frozen model (--kl-coef's reference) keeps only bfloat16 then.

The forward: PolicyNet (the FSDP root) runs the model's body (hidden states [B, T, H]), keeps the
positions whose next token is wanted (the loss mask: a prompt's logits are never needed), and computes LM
head + log_softmax over `chunk` of them at a time under torch.utils.checkpoint, so only one [chunk, V]
block of logits lives at any moment and backward recomputes it: values and gradients are the unchunked
ones. It also returns each selected position's policy entropy (no gradient). It works on a plain HF causal
LM or a wrapped one (PEFT), with or without FSDP (the root's all-gather and gradient reduce bracket it).
Design notes: DESIGN.md#the-trainer
"""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from buffer import Sample



# a micro-batch with nothing to learn (FSDP padding: a short rank still runs every collective)
EMPTY = Sample("empty", "empty", [0], [0], [0.0], [0], [], 0.0)


def collate(samples, device, version: int | None = None) -> dict:
    """Samples -> right-padded tensors. A response token at absolute position p has its behaviour
    logprob and loss mask at column p, the same column token_logprobs() gives its logprob. "fields": the
    per-token values by name, [B, T] float32 on the loss mask's columns too (0 elsewhere): each model
    token's policy version ("version"), its lag behind the trainer's `version` ("lag", when given), and
    each entry of Sample.token_fields (one value per model token; every sample of the batch has the same)."""
    B, width = len(samples), max(s.num_tokens for s in samples)
    input_ids = torch.zeros(B, width, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.long)
    old_logp = torch.zeros(B, width)
    mask = torch.zeros(B, width)
    names = sorted({k for s in samples for k in s.token_fields})
    if {"version", "lag"} & set(names):
        raise ValueError("Sample.token_fields: 'version' and 'lag' are the core's own per-token fields")
    fields = {k: torch.zeros(B, width) for k in ("version", *names)}
    for i, s in enumerate(samples):
        n_p, n = len(s.prompt_ids), s.num_tokens
        input_ids[i, :n] = torch.tensor(s.prompt_ids + s.response_ids)
        attn[i, :n] = 1
        old_logp[i, n_p:n] = torch.tensor(s.logprobs, dtype=torch.float32)
        mask[i, n_p:n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        cols = [n_p + j for j, x in enumerate(s.loss_mask) if x]          # its model tokens' columns
        for name, values in fields.items():
            got = s.versions if name == "version" else s.token_fields.get(name)
            if got is None or len(got) != len(cols):
                raise ValueError(f"sample {s.task_id}: per-token field {name!r} " + (
                    "missing (another sample of its micro-batch has it)" if got is None
                    else f"has {len(got)} values for its {len(cols)} model tokens"))
            values[i, cols] = torch.tensor(got, dtype=torch.float32)
    if version is not None:
        fields["lag"] = (version - fields["version"]) * mask
    t = dict(input_ids=input_ids, attn=attn, old_logp=old_logp, mask=mask)
    return {**{k: v.to(device) for k, v in t.items()}, "fields": {k: v.to(device) for k, v in fields.items()}}


def split(items: list, n: int) -> list[list]:
    """n contiguous parts of near-equal size (some empty when len(items) < n)."""
    return [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices into `lengths` grouped into micro-batches whose padded size (rows x longest row) stays
    within `budget` tokens (a longer sample goes alone). Greedy, longest first: each micro-batch holds
    neighbours in length order, so little is padding, and all but the last are about `budget` big."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    parts: list[list[int]] = []
    for i in order:
        if parts and (len(parts[-1]) + 1) * lengths[parts[-1][0]] <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts


def causal_lm(model):
    """The HF causal LM inside `model` (a PEFT model's base; LoRA layers are injected in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _head_logprobs(head, h: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """h [n, H], targets [n] -> (logprob of each target [n], entropy [n] without grad), float32 at least,
    of softmax(logits / temperature): the distribution an engine sampling at that temperature draws from."""
    logits = head(h)                                                 # [n, V]: the chunk's big tensors
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature                                # (one more [n, V], only while T != 1)
    logp = torch.log_softmax(logits, dim=-1)
    del logits                                                       # (one [n, V] fewer alive from here)
    with torch.no_grad():
        entropy = -logp.exp().mul_(logp).sum(-1)                     # -sum p log p, one [n, V] temporary
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


class PolicyNet(torch.nn.Module):
    """The trainer's forward: `model`'s body, then its LM head over `chunk` selected positions at a time.
    autocast: a dtype to run under torch.autocast (one rank in bf16; under FSDP its mixed-precision
    policy casts instead)."""

    def __init__(self, model, chunk: int = 1024, autocast: torch.dtype | None = None):
        super().__init__()
        self.model, self.chunk, self.autocast = model, chunk, autocast

    def forward(self, input_ids, attention_mask, select,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask, select: [B, T]; select marks the columns whose token's logprob is
        wanted (column 0 never counts: no context). Returns logp and entropy [N], N = selected columns
        in row-major order: logp with grad, entropy without (the entropy of the distribution the
        token was drawn from, i.e. at the position before it), both of softmax(logits / temperature)."""
        lm = causal_lm(self.model)
        with torch.autocast(input_ids.device.type, dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):
            hidden = lm.model(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False).last_hidden_state                  # [B, T, H]
            sel = select[:, 1:].bool()                                             # [B, T-1]
            h = hidden[:, :-1][sel]                                                # [N, H]
            targets = input_ids[:, 1:][sel]                                        # [N]
            outs = []
            # at least one chunk, even of 0 rows: every rank's backward then reaches the head's weight
            # (FSDP reduces the gradients of the same parameters on every rank)
            for i in range(0, max(len(h), 1), self.chunk):
                piece = (h[i:i + self.chunk], targets[i:i + self.chunk], temperature)
                outs.append(checkpoint(_head_logprobs, lm.lm_head, *piece, use_reentrant=False)
                            if torch.is_grad_enabled() else _head_logprobs(lm.lm_head, *piece))
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   mask: torch.Tensor | None = None, chunk: int = 1024,
                   entropy: list | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of every selected token given the tokens before it, under `model` (a PolicyNet, or an HF /
    PEFT causal LM, wrapped here). input_ids, attention_mask: [B, T], right-padded; mask [B, T]: the
    columns wanted (default: every real token). Returns [B, T] float32, 0 at column 0 (no context)
    and at unselected columns (float32; float64 for a float64 model); matches the engine's (float32).
    entropy: a list that receives the selected positions' entropies [N] (no grad). temperature: of
    softmax(logits / temperature), the distribution an engine sampling at it reports (--temperature)."""
    net = model if isinstance(model, PolicyNet) else PolicyNet(model, chunk)
    select = (attention_mask if mask is None else mask * attention_mask) != 0           # [B, T]
    select[:, 0] = False
    logp, ent = net(input_ids, attention_mask, select, temperature=temperature)       # [N], [N]
    if entropy is not None:
        entropy.append(ent)
    return torch.zeros(select.shape, dtype=logp.dtype, device=input_ids.device).masked_scatter(select, logp)


# ---------------------------------------------------------------------------------------------
# the model on the trainer ranks


def build(model_dir: str, device, trainer_group=None, bf16: bool = False, chunk: int = 1024, weights=None,
          checkpointing: bool = False, frozen: bool = False):
    """(HF model, PolicyNet over it) on this rank; trainer_group: the trainer group when it has several ranks.
    weights: trainer.Weights, which may wrap the model (ext/lora.py: PEFT's adapter, still to be set) and
    names its tensors in the model dir. checkpointing: recompute each decoder layer in backward
    (transformers', non-reentrant). frozen: no gradients, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM
    device = torch.device(device)
    dtype = torch.bfloat16 if bf16 and frozen else torch.float32
    if trainer_group is not None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    if weights is not None:
        model = weights.wrap(model)
    if frozen:
        model.requires_grad_(False).eval()
    elif checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # one rank in bf16: autocast over float32 weights; under FSDP its mixed-precision policy casts
    net = PolicyNet(model, chunk, autocast=torch.bfloat16 if bf16 and trainer_group is None else None)
    if trainer_group is not None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        ranks = torch.tensor(dist.get_process_group_ranks(trainer_group))
        mesh = DeviceMesh.from_group(trainer_group, device.type, mesh=ranks)
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                  else MixedPrecisionPolicy())
        # (a wrapped model, PEFT's: the decoder layers are the wrapped model's; frozen weights shard alike)
        for layer in causal_lm(model).model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(net, mesh=mesh, mp_policy=policy)       # the root: embeddings, final norm, head
        net.to_empty(device=device)                        # this rank's shards, still unset
        reset_buffers(model, device)
        read_own_shards(model, model_dir, trainer_group, weights)
    return model, net


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


def read_own_shards(model, model_dir: str, trainer_group, weights=None):
    """Each rank reads only its own shards of model_dir's safetensors into `model`'s sharded weights
    (torch.distributed.checkpoint's HF reader reads slices; a checkpoint in bfloat16 is cast into the
    float32 masters). Names: weights.checkpoint_name maps a wrapped model's back to the checkpoint's (None:
    not in it, e.g. an adapter's); a tied head is the embedding (one tensor)."""
    import torch.distributed.checkpoint as dcp
    if not any(Path(model_dir).glob("*.safetensors")):
        raise ValueError(f"{model_dir}: --train-gpus > 1 reads each rank's shards from *.safetensors, and "
                         f"this dir has none (re-save it with save_pretrained(..., safe_serialization=True))")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    want = {}
    for name, t in model.state_dict().items():
        hf = weights.checkpoint_name(name) if weights is not None else name
        if hf is not None and not (tied and hf == "lm_head.weight"):
            want[hf] = t
    dcp.load(want, storage_reader=dcp.HuggingFaceStorageReader(model_dir), process_group=trainer_group)


