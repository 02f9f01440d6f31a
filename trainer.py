"""trainer.py: the training side. Model, optimizer, data parallel, logprobs, weight broadcast, checkpoints.

Runs on every trainer rank (torch.distributed group `trainer_group`):

    trainer = Trainer(model_dir, TrainConfig(...), trainer_group)
    metrics = trainer.train_step(samples, group_size)        # one optimizer step on this rank's shard
    named = trainer.full_state()                             # full HF-named weights (collective)
    trainer.save_checkpoint(out_dir, state)                  # collective; rank 0 writes

Data parallel is FSDP2 (`fully_shard` on each decoder layer and on the whole model) over the
trainer group when it has more than one rank, so a model larger than one GPU trains; gradients are
averaged across ranks by FSDP's reduce-scatter. `full_state()` gathers full tensors (DTensor
full_tensor) for the weight broadcast and for checkpoints.

Weight broadcast (`broadcast_weights` / `receive_weights`): trainer rank 0 sends the full weights
to every rollout rank over the weight-sync group (gloo on CPU, NCCL on GPU), in flat buckets of
about `bucket_mb` each; both sides derive the bucket plan from the same (name, shape, dtype) list,
so tensors arrive under their HF names and the engines load them as they are.

Deliberate simplifications:
- One optimizer step per batch (no PPO epochs / mini-batches): the paper's off-policy corrections
  are about rollout staleness, which this keeps visible.
- Loss normalisation across micro-batches and ranks: each rank's loss is its local token-mean (or
  seq-mean) and FSDP averages the ranks' gradients, so ranks weigh equally rather than by their
  token counts; with the round-robin batch split the difference is small.
- The optimizer state is saved per trainer rank (its FSDP shards); resuming needs the same number
  of trainer ranks. The model itself is saved whole, in HF format.
"""

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import losses


@dataclass
class TrainConfig:
    loss: str = "ppo"                 # one of losses.VARIANTS
    lr: float = 3e-4                  # AdamW learning rate
    weight_decay: float = 0.0
    grad_clip: float = 1.0            # max global grad norm
    warmup_steps: int = 10            # linear LR warm-up: Adam's first steps are sign-like and large
    clip_low: float = 0.2             # PPO-family ratio clip
    clip_high: float = 0.28           # DAPO's clip-higher
    agg: str = "token-mean"           # losses' aggregation
    micro_batch: int = 64             # sequences per forward/backward
    bucket_mb: int = 64               # weight broadcast bucket size, MiB
    seed: int = 0

    def __post_init__(self):
        if self.loss not in losses.VARIANTS:
            raise ValueError(f"--loss {self.loss!r}: must be one of {', '.join(losses.VARIANTS)}")
        if self.lr <= 0 or self.micro_batch < 1 or self.bucket_mb < 1:
            raise ValueError("TrainConfig: lr must be > 0, micro_batch and bucket_mb >= 1")


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logprob of every token given the tokens before it, under `model`.

    input_ids, attention_mask: [B, T], right-padded. Returns [B, T] float32; column 0 (no context)
    and padded positions are 0. Matches what the engine reports for the same tokens (float32)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()  # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)                                    # [B, T-1, V]
    taken = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)                         # [B, T-1]
    return torch.cat([torch.zeros_like(taken[:, :1]), taken * attention_mask[:, 1:]], dim=1)


def collate(samples, device) -> dict[str, torch.Tensor]:
    """Samples -> right-padded tensors. A response token at absolute position p has its behaviour
    logprob and loss mask at column p, the same column token_logprobs() gives its logprob."""
    width = max(s.num_tokens for s in samples)
    B = len(samples)
    input_ids = torch.zeros(B, width, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.long)
    old_logp = torch.zeros(B, width)
    mask = torch.zeros(B, width)
    for i, s in enumerate(samples):
        n_p, n = len(s.prompt_ids), s.num_tokens
        input_ids[i, :n] = torch.tensor(s.prompt_ids + s.response_ids)
        attn[i, :n] = 1
        old_logp[i, n_p:n] = torch.tensor(s.logprobs, dtype=torch.float32)
        mask[i, n_p:n] = torch.tensor(s.loss_mask, dtype=torch.float32)
    return {k: v.to(device) for k, v in dict(input_ids=input_ids, attn=attn, old_logp=old_logp, mask=mask).items()}


class Trainer:
    def __init__(self, model_dir: str, cfg: TrainConfig, group=None, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.group = group
        self.device = torch.device(device)
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.fsdp = self.world > 1
        if self.fsdp:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            ranks = dist.get_process_group_ranks(group)
            mesh = DeviceMesh.from_group(group, self.device.type, mesh=torch.tensor(ranks))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.num_steps = 0                # optimizer steps taken (restored from checkpoints)

    # --- training
    def train_step(self, samples, advantages: list[float]) -> dict:
        """One optimizer step on this rank's samples. advantages: one per sample (GRPO)."""
        cfg = self.cfg
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        total_tokens = sum(sum(s.loss_mask) for s in samples)
        metrics_sum: dict[str, float] = {}
        loss_sum = 0.0
        for i in range(0, len(samples), cfg.micro_batch):
            mb = samples[i:i + cfg.micro_batch]
            t = collate(mb, self.device)
            adv = torch.tensor(advantages[i:i + cfg.micro_batch], dtype=torch.float32, device=self.device)
            prox = None
            if cfg.loss == "decoupled_ppo":
                # proximal logprobs: the weights before this update. One optimizer step per batch means
                # these are the current weights, computed without grad before any step is taken.
                with torch.no_grad():
                    prox = token_logprobs(self.model, t["input_ids"], t["attn"])
            logp = token_logprobs(self.model, t["input_ids"], t["attn"])
            loss, m = losses.compute_policy_loss(
                logp, t["old_logp"], adv, t["mask"], cfg.loss, prox_logp=prox,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.agg)
            # weight micro-batches so the step's loss is the token-mean over the rank's whole batch
            frac = (sum(sum(s.loss_mask) for s in mb) / max(total_tokens, 1)) if cfg.agg == "token-mean" \
                else len(mb) / len(samples)
            (loss * frac).backward()
            loss_sum += loss.item() * frac
            for k, v in m.items():
                metrics_sum[k] = metrics_sum.get(k, 0.0) + v * frac
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = cfg.lr * min(1.0, (self.num_steps + 1) / max(cfg.warmup_steps, 1))
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.num_steps += 1
        return {"loss": loss_sum, "grad_norm": float(grad_norm), "lr": lr, **metrics_sum}

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The trainer's logprobs of a probe sequence (collective under FSDP: call on every trainer rank)."""
        self.model.eval()
        ids = torch.tensor([token_ids], device=self.device)
        return token_logprobs(self.model, ids, torch.ones_like(ids))[0, 1:].tolist()

    # --- weights out
    def full_state(self) -> list[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under their HF names, on CPU. Collective under FSDP.
        A tied lm_head is left out: HF checkpoints don't carry it and engines re-tie it."""
        out = []
        for name, v in self.model.state_dict().items():
            if self.tied and name == "lm_head.weight":
                continue
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            out.append((name, v.detach().to("cpu")))
        return out

    # --- checkpoints
    def save_checkpoint(self, out_dir: str, state: dict, tokenizer_dir: str):
        """<out_dir>/checkpoint -> checkpoint-<step>: HF model (safetensors + config) + tokenizer,
        optimizer shard per trainer rank, state.json (step, version, data position...; written last).
        Written to checkpoint-<step>.tmp, renamed to checkpoint-<step>, then the `checkpoint` symlink
        is switched to it by one atomic rename and older checkpoint-* dirs are removed: a SIGKILL at
        any moment leaves `checkpoint` pointing at a complete checkpoint, the new one or the one
        before (leftovers go at the next save). A write that fails (a full disk...) removes its .tmp
        and says why. Collective: every trainer rank calls it."""
        out = Path(out_dir)
        name = f"checkpoint-{state['step']:06d}"
        tmp, final, link = out / f"{name}.tmp", out / name, out / "checkpoint"
        named = self.full_state()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.group is not None:
            dist.barrier(group=self.group)
        try:
            torch.save(self.opt.state_dict(), tmp / f"optimizer.rank{self.rank}.pt")
            if self.rank == 0:
                self._write_model(tmp, named, state, tokenizer_dir)
        except (OSError, RuntimeError) as e:   # torch.save reports a full disk as RuntimeError("... iostream error")
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(checkpoint_error(tmp, e)) from e
        if self.group is not None:
            dist.barrier(group=self.group)
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)      # a killed save of this same step left it unlinked
            os.replace(tmp, final)
            if link.exists() and not link.is_symlink():   # a checkpoint dir of the earlier layout
                os.replace(link, out / "checkpoint-legacy")
            new_link = out / "checkpoint.link-tmp"
            new_link.unlink(missing_ok=True)
            os.symlink(name, new_link)
            os.replace(new_link, link)                    # the switch: atomic
            for old in out.glob("checkpoint-*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)

    def _write_model(self, tmp: Path, named, state: dict, tokenizer_dir: str):
        from safetensors.torch import save_file
        from transformers import AutoTokenizer

        self.model.config.save_pretrained(tmp)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(tmp)
        save_file({n: t.contiguous() for n, t in named}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        (tmp / "state.json").write_text(json.dumps(state, indent=2))

    def load_optimizer(self, ckpt_dir: str):
        path = Path(ckpt_dir) / f"optimizer.rank{self.rank}.pt"
        if not path.exists():
            raise FileNotFoundError(f"--resume: {path} missing (resume needs the same number of trainer ranks)")
        # weights_only: a crafted optimizer file must not run code on --resume
        self.opt.load_state_dict(torch.load(path, weights_only=True))


def checkpoint_error(tmp: Path, e: BaseException) -> str:
    """A checkpoint write failed: say where, why, and whether the disk is full (torch.save and
    safetensors often report a full disk only as an I/O error)."""
    msg = f"writing the checkpoint to {tmp} failed: {e}"
    try:
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        return msg
    if getattr(e, "errno", None) == errno.ENOSPC or free < 64 << 20:
        msg += f" -- No space left on device ({free / 2**20:.1f} MiB free on {tmp.parent})"
    return msg + "; the previous checkpoint, if any, is untouched"


def read_checkpoint_state(out_dir: str) -> dict | None:
    """The latest complete checkpoint's state.json, or None when out_dir holds none."""
    path = Path(out_dir) / "checkpoint" / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------------------------------------
# weight broadcast: trainer rank 0 -> rollout ranks, in buckets


def weight_meta(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int], str]]:
    return [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]


def plan_buckets(meta, bucket_bytes: int) -> list[list[int]]:
    """Indices of `meta` grouped into buckets of one dtype and about bucket_bytes each."""
    buckets, cur, size, cur_dtype = [], [], 0, None
    for i, (_, shape, dtype) in enumerate(meta):
        nbytes = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
        if cur and (size + nbytes > bucket_bytes or dtype != cur_dtype):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
        cur_dtype = dtype
    if cur:
        buckets.append(cur)
    return buckets


def broadcast_weights(named, group, bucket_bytes: int, device, who: str):
    """Sender side (trainer rank 0 = global rank 0). Collective over `group`."""
    meta = weight_meta(named)
    for b, idx in enumerate(plan_buckets(meta, bucket_bytes)):
        flat = torch.cat([named[i][1].reshape(-1) for i in idx]).to(device)
        _broadcast(flat, group, who, f"weight broadcast bucket {b}")


def receive_weights(meta, group, bucket_bytes: int, device, who: str) -> list[tuple[str, torch.Tensor]]:
    """Receiver side (rollout ranks). Returns HF-named CPU tensors. Runs in a worker thread: the
    current CUDA device is per thread, so it is set here (else every rank would receive on cuda:0)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    out = []
    for b, idx in enumerate(plan_buckets(meta, bucket_bytes)):
        sizes = [torch.Size(meta[i][1]).numel() for i in idx]
        flat = torch.empty(sum(sizes), dtype=getattr(torch, meta[idx[0]][2]), device=device)
        _broadcast(flat, group, who, f"weight broadcast bucket {b}")
        for i, chunk in zip(idx, torch.split(flat.cpu(), sizes)):
            out.append((meta[i][0], chunk.view(meta[i][1])))
    return out


def _broadcast(t: torch.Tensor, group, who: str, phase: str):
    try:
        dist.broadcast(t, src=0, group=group)  # src is a global rank: trainer rank 0
    except RuntimeError as e:  # gloo/NCCL timeouts surface as RuntimeError
        raise RuntimeError(f"{who}: {phase} failed or timed out: {e}") from None

