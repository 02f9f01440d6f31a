"""trainer.py: the training side, on every trainer rank: model, optimizer, FSDP2 data parallel,
mixed precision, logprobs, checkpoints, and the run-dir checks (the ranks in lockstep: ranks.py).

    trainer = Trainer(model_dir, TrainConfig(...), trainer_group)
    metrics = trainer.train_step(samples, advantages, version)   # this rank's shard of the batch
    for name, tensor in trainer.iter_full_state(): ...           # full HF-named weights (collective)
    trainer.save_checkpoint(out_dir, state)                       # collective; rank 0 writes

FSDP2 (`fully_shard` per decoder layer, then the root) over the trainer group when it has more than
one rank; no rank then holds the whole model: it is built on the meta device, sharded, and each rank
reads only its own shards (model.py). --precision bf16: bfloat16 compute, float32 master weights, optimizer
state and gradient reduce. Log-probs come from model.PolicyNet (the LM head chunk by chunk, never
[B, T, V]); micro-batches are --micro-batch samples or packed by --max-tokens-per-micro. A batch is
--ppo-epochs passes of --mini-batches optimizer steps; under FSDP every rank runs the same number of
micro-batches (short ranks run empty ones of weight 0). --kl-coef > 0 adds a KL penalty to a frozen,
sharded copy of the initial model (a Weights that can switch itself off, LoRA's: the base, adapter off).
What trains, travels to the engines and is saved is a Weights (the whole model; ext/lora.py: an adapter).
Each micro-batch (Trainer.micro: whole batches and the streaming trainer's alike) carries its samples'
per-token fields to the loss (each token's version, its lag behind the trainer, Sample.token_fields), and
every losses.ADV_SHAPERS entry may turn its per-sample advantages into per-token ones.
Under FSDP a step's loss is the mean
over every rank's tokens (or sequences), as on one rank. Simplifications: mini-batches keep their samples
across epochs; the optimizer state is saved per rank, so a resume needs the same --train-gpus.
Details: DESIGN.md#trainerpy.
"""

import errno
import functools
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

import losses
import model as model_mod
from config import check, opt
from model import EMPTY, collate, pack_by_tokens, split, token_logprobs


@dataclass
class TrainConfig(losses.LossConfig):
    """The trainer's settings; the loss and its hyperparameters are losses.LossConfig's fields."""
    lr: float = opt(3e-4, "AdamW learning rate (linear warm-up over the first --warmup-steps steps)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max global gradient norm")
    warmup_steps: int = opt(10, "linear LR warm-up, optimizer steps (Adam's first steps are sign-like and "
                                "large)")
    ppo_epochs: int = opt(1, "passes over each batch")
    mini_batches: int = opt(1, "optimizer steps per pass (the batch split into this many); "
                               "decoupled_ppo's proximal policy is frozen before the first, so its clip acts "
                               "from the second on")
    recompute_old_logprobs: bool = opt(False, "the ratio's old policy is the trainer before the update, not "
                                              "the engine (mu); mu stays in decoupled_ppo's and "
                                              "--is-correction's weights (losses table: DESIGN.md)")
    micro_batch: int = opt(64, "sequences per forward/backward on a trainer rank")
    max_tokens_per_micro: int = opt(0, "micro-batches packed by tokens instead: rows x longest row <= this "
                                       "(greedy, longest first; a longer sample goes alone); 0 = off "
                                       "(--micro-batch samples each)")
    precision: str = opt("auto", "training precision: bf16 (bfloat16 compute, float32 master weights, "
                                 "optimizer state and gradient reduce) | fp32 | auto (bf16 on GPU, fp32 on "
                                 "CPU)")
    grad_checkpointing: str = opt("auto", "recompute each decoder layer's activations in backward "
                                          "(non-reentrant): on | off | auto (on on GPU, off on CPU)",
                                  const="on")
    logits_chunk: int = opt(1024, "positions per LM-head chunk in the log-prob forward: its [chunk, vocab] "
                                  "float32 logits are the largest tensor there")
    seed: int = opt(0, "seeds the trainer, the data order and the engines (rollout rank i: seed + i)")
    def __post_init__(self):
        super().__post_init__()
        check(self, at_least=dict(micro_batch=1, ppo_epochs=1, mini_batches=1, warmup_steps=0,
                                  max_tokens_per_micro=0, logits_chunk=1, weight_decay=0),
              above=dict(lr=0, grad_clip=0),
              one_of=dict(precision=("auto", "bf16", "fp32"), grad_checkpointing=("auto", "on", "off")))

    def resolved(self, device: str) -> "TrainConfig":
        """The settings that default to the device's: bf16 and activation checkpointing on GPU, not on CPU
        (so the CPU tests stay exact in float32)."""
        gpu = str(device).startswith("cuda")
        precision = self.precision if self.precision != "auto" else "bf16" if gpu else "fp32"
        recompute = self.grad_checkpointing if self.grad_checkpointing != "auto" else "on" if gpu else "off"
        return replace(self, precision=precision, grad_checkpointing=recompute)


def add_gap(gap: dict, mb: dict, trainer_logp: torch.Tensor):
    """Accumulate |engine - trainer| logprob over the micro-batch's response tokens, for all samples
    and for the on-policy ones (gap: {"all": [sum, tokens], "on_policy": [sum, tokens]})."""
    diff = (mb["old_logp"] - trainer_logp).abs() * mb["mask"]                   # [B, T]
    for key, rows in (("all", torch.ones_like(mb["on_policy"])), ("on_policy", mb["on_policy"])):
        gap[key][0] += diff[rows].sum().item()
        gap[key][1] += mb["mask"][rows].sum().item()


class Weights:
    """What the trainer trains, syncs into the engines and saves: the whole model. A Weights of another
    kind (ext/lora.py: a PEFT adapter on the frozen model) overrides these."""
    switchable = False    # True: off(model), a context without them, is the initial model (--kl-coef's)

    def wrap(self, model):
        """The model to train (before sharding; its decoder layers must stay the model's own)."""
        return model

    def checkpoint_name(self, name: str) -> str | None:
        """A model tensor's name in the model dir (None: not there, so not read from it)."""
        return name

    def init(self, model, seed: int):
        """Set what the model dir does not hold (starting values the same on one rank or many)."""

    def named(self, model, tied: bool) -> list:
        """(HF name, tensor) of what the engines load, without gathering: every weight but a tied lm_head
        (HF checkpoints don't carry it and engines re-tie it)."""
        return [(n, v) for n, v in model.state_dict().items() if not (tied and n == "lm_head.weight")]

    def save(self, tmp: Path, named, model, base_dir: str):
        """The checkpoint's model files in tmp: config, generation config, safetensors."""
        from safetensors.torch import save_file
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        save_file({n: t.contiguous() for n, t in named}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})


class Trainer:
    def __init__(self, model_dir: str, cfg: TrainConfig, trainer_group=None, device: str = "cpu",
                 weights: Weights | None = None, ref_dir: str = "", fsdp: bool = False,
                 temperature: float = 1.0):
        """weights: what trains, syncs and is saved (default: the whole model; ext/lora.py: an adapter,
        whose tensors are then all that named_weights() and the checkpoints hold). ref_dir: --kl-coef's
        reference model (default model_dir; a resumed run passes the model it started from). fsdp: the
        sharded path (FSDP2) even when `trainer_group` has one rank (tools/gpu_check.py checks it on one GPU);
        with several ranks it is always taken.
        temperature: the engines' sampling temperature (--temperature); every log-prob the loss sees (the
        policy's, pi_prox's, the reference's) is of softmax(logits / temperature), the distribution the
        engines sample from and report (vllm_engine: processed logprobs)."""
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"--temperature must be > 0 to train on its samples, got {temperature}")
        self.temperature = temperature
        self.device = torch.device(device)
        self.cfg = cfg = cfg.resolved(self.device.type)
        self.weights = weights or Weights()
        self.trainer_group = trainer_group
        self.world = dist.get_world_size(trainer_group) if trainer_group is not None else 1
        self.rank = dist.get_rank(trainer_group) if trainer_group is not None else 0
        self.fsdp = self.world > 1 or (fsdp and trainer_group is not None)
        self.bf16 = cfg.precision == "bf16"
        torch.manual_seed(cfg.seed)
        build = functools.partial(model_mod.build, device=self.device, bf16=self.bf16, chunk=cfg.logits_chunk,
                                  trainer_group=trainer_group if self.fsdp else None)
        self.model, self.net = build(model_dir, weights=self.weights,
                                     checkpointing=cfg.grad_checkpointing == "on")
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.weights.init(self.model, cfg.seed)
        # --kl-coef: a frozen copy of the initial model, sharded like the policy (a switchable Weights: the
        # model itself with them switched off, so no copy); 0 = none loaded
        self.ref_net = (build(ref_dir or model_dir, frozen=True)[1]
                        if cfg.kl_coef > 0 and not self.weights.switchable else None)
        # what is frozen (LoRA's base) has no optimizer state
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                     weight_decay=cfg.weight_decay)
        self.num_steps = 0                # batches trained (restored on resume; the LR warm-up counts these)

    # --- training
    def train_step(self, samples, advantages: list[float], version: int | None = None) -> dict:
        """One batch on this rank: ppo_epochs passes over its samples, each pass mini_batches
        optimizer steps. advantages: one per sample (GRPO). version: the policy version these weights
        are (the trainer's, before this batch): samples wholly of that version are on-policy, so their
        engine/trainer logprob gap is numerical mismatch alone (logp_diff_on_policy), not staleness; each
        token's lag (losses.Terms.lag) is counted from it (None: no lag).

        The trainer's logprobs before the first update (`pre`) are computed first, without grad,
        when the loss needs them: decoupled_ppo's proximal policy, frozen for the whole batch (so its
        clip acts from the second optimizer step on), --is-correction's pi_prox (the same role, on top
        of any loss), or --recompute-old-logprobs (they take mu's place in the ratio; mu stays in the
        weights: losses.compute_policy_loss's ref_prox). --kl-coef's reference logprobs likewise, once.
        Every log-prob is computed at the loss mask's positions only (model.PolicyNet); `entropy` is
        the policy's mean entropy there.
        Returns metrics averaged over the optimizer steps (rank 0's: each rank reports its own shard);
        self.update_metrics keeps them per step."""
        cfg = self.cfg
        self.model.train()
        plan = self._plan(samples, advantages, version)     # [mini-batch][micro-batch] -> tensors
        for micro in (mb for mini in plan for mb in mini):
            self.prepare(micro)
        lr = self.set_lr()
        gap = {"all": [0.0, 0.0], "on_policy": [0.0, 0.0]}    # sum |logp_engine - logp_trainer|, tokens
        self.update_metrics = []
        for epoch in range(cfg.ppo_epochs):
            for j, mini in enumerate(plan):
                self.opt.zero_grad(set_to_none=True)
                sums: dict[str, float] = {"loss": 0.0}
                for mb in mini:
                    # weights: the step's loss is the mini-batch's mean over every rank (_plan)
                    first = epoch == 0 and (j == 0 or "pre" in mb)      # (the gap: before any update)
                    self.forward_backward(mb, mb["weight"], sums, gap if first else None,
                                          grad_weight=mb["grad_weight"])
                self.update_metrics.append({**sums, "grad_norm": self.clip_and_step()})
        self.num_steps += 1
        return self.step_metrics(lr, gap)

    # --- the pieces of a step (train_step; ext/stream_trainer.GradStream uses them too)
    def set_lr(self) -> float:
        """The step's learning rate (linear warm-up over the batches trained so far), set; returned."""
        lr = self.cfg.lr * min(1.0, (self.num_steps + 1) / max(self.cfg.warmup_steps, 1))
        for g in self.opt.param_groups:
            g["lr"] = lr
        return lr

    @torch.no_grad()
    def prepare(self, mb: dict):
        """What micro-batch mb needs from the weights before any update: the trainer's own logprobs
        (`pre`) when the loss needs them, --kl-coef's reference logprobs."""
        cfg = self.cfg
        if losses.LOSSES[cfg.loss].needs_prox or cfg.recompute_old_logprobs or cfg.is_correction != "none":
            mb["pre"] = self.logprobs(mb)
        if cfg.kl_coef > 0:
            mb["ref"] = self.ref_logprobs(mb)

    def forward_backward(self, mb: dict, weight: float, sums: dict, gap: dict | None = None,
                         grad_weight: float | None = None):
        """One micro-batch: the loss's gradient times `grad_weight` (default `weight`) accumulated into
        .grad; its metrics times `weight` added to `sums`; with `gap`, the engine/trainer logprob gap before
        any update."""
        cfg = self.cfg
        entropy = []
        logp = self.logprobs(mb, entropy)                                      # [B, T], with grad
        if gap is not None:                                   # trainer logprobs before any update: the gap
            add_gap(gap, mb, mb.get("pre", logp.detach()))
        loss, m = losses.compute_policy_loss(logp, mb["old_logp"], mb["adv"], mb["mask"], cfg.loss,
                                             prox_logp=mb.get("pre"), fields=mb["fields"],
                                             ref_prox=cfg.recompute_old_logprobs, **cfg.loss_kwargs())
        if cfg.kl_coef > 0:
            kl, kl_m = losses.kl_penalty(logp, mb["ref"], mb["mask"], agg=cfg.agg)
            loss = loss + cfg.kl_coef * kl
            m.update(kl_m)
        m["entropy"] = (entropy[0].sum() / max(len(entropy[0]), 1)).item()   # over the mask
        (loss * (weight if grad_weight is None else grad_weight)).backward()
        for k, v in {"loss": loss.item(), **m}.items():
            sums[k] = sums.get(k, 0.0) + v * weight

    def clip_and_step(self) -> float:
        """Clip the accumulated gradient's global norm, take the optimizer step; returns the norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.opt.step()
        return float(grad_norm)

    def step_metrics(self, lr: float, gap: dict) -> dict:
        """A step's metrics: its updates' mean, the learning rate, memory, the logprob gap."""
        out = {k: sum(u[k] for u in self.update_metrics) / len(self.update_metrics)
               for k in self.update_metrics[0]}
        out.update(lr=lr, num_updates=len(self.update_metrics), **self.memory())
        for key, (total, n) in gap.items():
            if n:
                out[f"logp_diff_{key}"] = total / n       # mean |engine - trainer| per response token
        return out

    def memory(self) -> dict:
        """This rank's optimizer state (MB; its shard under FSDP) and peak memory so far (GB: the GPU's
        allocations, or on CPU the process's peak resident set, libraries included)."""
        state = sum(getattr(t, "_local_tensor", t).nbytes for st in self.opt.state.values()
                    for t in st.values() if torch.is_tensor(t))
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # (Linux: KiB)
        return {"optimizer_state_mb": state / 1e6, "mem_peak_gb": peak / 1e9}

    def logprobs(self, mb: dict, entropy: list | None = None) -> torch.Tensor:
        """The policy's logprobs [B, T] of micro-batch t's tokens at its loss mask (0 elsewhere), at the
        sampling temperature."""
        return token_logprobs(self.net, mb["input_ids"], mb["attn"], mb["mask"], entropy=entropy,
                              temperature=self.temperature)

    @torch.no_grad()
    def ref_logprobs(self, mb: dict) -> torch.Tensor:
        """--kl-coef's reference logprobs [B, T] (the initial model; a switchable Weights: this model with
        them off)."""
        if self.ref_net is not None:
            return token_logprobs(self.ref_net, mb["input_ids"], mb["attn"], mb["mask"],
                                  temperature=self.temperature)
        with self.weights.off(self.model):
            return self.logprobs(mb)

    def _plan(self, samples, advantages, version) -> list[list[dict]]:
        """This rank's samples as mini-batches of collated micro-batches, each with its loss weight.
        Micro-batches: --micro-batch samples each, or (--max-tokens-per-micro) packed by tokens.
        Under FSDP every rank must run the same number of forward/backward passes and optimizer steps
        (each is a collective): each mini-batch's micro-batch count is the largest rank's, and a rank
        with fewer runs empty micro-batches (one masked token, weight 0) in their place."""
        cfg = self.cfg
        order = list(range(len(samples)))
        if cfg.mini_batches > 1:      # a batch arrives grouped by prompt: mini-batches mix prompts
            order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(
                cfg.seed * 100_003 + self.num_steps)).tolist()
        minis = split(order, cfg.mini_batches)
        pack = cfg.max_tokens_per_micro
        if pack:
            parts = []
            for mini in minis:
                packed = pack_by_tokens([samples[i].num_tokens for i in mini], pack)
                parts.append([[mini[k] for k in part] for part in packed])
            counts = [len(p) for p in parts]
        else:          # near-equal parts of at most --micro-batch samples
            counts = [math.ceil(math.ceil(len(samples) / cfg.mini_batches) / cfg.micro_batch)] * len(minis)
        counts = torch.tensor([max(1, c) for c in counts], device=self.device)      # per mini-batch
        if self.fsdp:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.trainer_group)
        plan = []
        for j, (mini, count) in enumerate(zip(minis, counts.tolist())):
            # the largest rank's count: packed parts padded with empty ones, or that many equal parts
            mini_parts = parts[j] + [[]] * (count - len(parts[j])) if pack else split(mini, count)
            plan.append([self.micro([samples[i] for i in part], [advantages[i] for i in part], version)
                         for part in mini_parts])
        # Each micro-batch's loss is a mean over its own tokens (or sequences: losses.agg_count); weighed by
        # its count over the mini-batch's count on all ranks, the sum is the mini-batch's mean over every
        # rank. FSDP averages the ranks' gradients (1 / world), so the gradient's weight is world times that.
        # (The rank's own count instead would weigh a rank of 30 tokens beside one of 700 23x too much.)
        for mb in (mb for mini in plan for mb in mini):
            mb["count"] = losses.agg_count(mb["mask"], cfg.agg)                   # (0 for an empty one)
        local = torch.tensor([float(sum(mb["count"] for mb in mini)) for mini in plan], dtype=torch.float64,
                             device=self.device)                                 # [mini-batches]
        total = local.clone()
        if self.fsdp:
            dist.all_reduce(total, group=self.trainer_group)
        for mini, own, every in zip(plan, local.tolist(), total.tolist()):
            for mb in mini:
                mb["weight"] = mb["count"] / max(own, 1.0)        # the metrics: this rank's own mean
                mb["grad_weight"] = mb["count"] * self.world / max(every, 1.0)
        return plan

    def micro(self, samples, advantages: list[float], version) -> dict:
        """A micro-batch's tensors (no samples: one EMPTY row, the FSDP padding), without its weight: the
        per-token fields (losses.Fields; lag behind `version`), and the advantages every losses.ADV_SHAPERS
        entry made of the samples' own."""
        batch = samples or [EMPTY]
        mb = collate(batch, self.device, version)
        mb["fields"] = losses.Fields(mb["fields"], mb["mask"])
        mb["adv"] = torch.tensor(list(advantages) or [0.0], dtype=torch.float32, device=self.device)
        # a sample wholly of the trainer's version (none: no such version)
        mb["on_policy"] = torch.tensor([set(s.versions) == {version} for s in batch], device=self.device)
        for name, shape in losses.ADV_SHAPERS.items():
            mb["adv"] = shape(mb, self.cfg.hparams.get(name))
        return mb

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The trainer's logprobs of a probe sequence (collective under FSDP: call on every trainer rank), at
        temperature 1 whatever --temperature: the engines score the probe as prompt logprobs, which vLLM takes
        from the raw logits (it checks the weights, not the sampling)."""
        self.model.eval()
        ids = torch.tensor([token_ids], device=self.device)
        return token_logprobs(self.net, ids, torch.ones_like(ids))[0, 1:].tolist()

    # --- weights out
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of what the engines load, without gathering (a sharded DTensor knows its
        full shape): Weights.named's."""
        return self.weights.named(self.model, self.tied)

    def iter_full_state(self, dtypes: list[torch.dtype] | None = None):
        """(HF name, full tensor on this rank's device), one weight at a time: under FSDP each is one
        all-gather, so the extra memory is one weight, not the model. dtypes (a weight sync: the engine's,
        one per weight): each shard is cast before its gather, which then moves and holds that dtype (bf16:
        half of float32's bytes). Collective: every trainer rank iterates it to the end, in the same order,
        with the same dtypes."""
        for i, (name, v) in enumerate(self.named_weights()):
            if dtypes is not None:
                v = v.to(dtypes[i])
            yield name, (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()

    def full_state(self, rank0_only: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under their HF names, on CPU. Collective under FSDP. rank0_only
        (checkpoints, which rank 0 writes): the other ranks take part in every gather but keep nothing and
        get [] (a full copy in each rank's host memory: ~30 GB of float32 at 7B)."""
        return [(n, t.to("cpu")) for n, t in self.iter_full_state() if not rank0_only or self.rank == 0]

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
        named = self.full_state(rank0_only=True)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.trainer_group is not None:
            dist.barrier(group=self.trainer_group)
        try:
            torch.save(self.opt.state_dict(), tmp / f"optimizer.rank{self.rank}.pt")
            if self.rank == 0:
                self._write_model(tmp, named, state, tokenizer_dir)
        except (OSError, RuntimeError) as e:
            # torch.save reports a full disk as RuntimeError("... iostream error")
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(checkpoint_error(tmp, e)) from e
        if self.trainer_group is not None:
            dist.barrier(group=self.trainer_group)
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)      # a killed save of this same step left it unlinked
            os.replace(tmp, final)
            new_link = out / "checkpoint.link-tmp"
            new_link.unlink(missing_ok=True)
            os.symlink(name, new_link)
            os.replace(new_link, link)                    # the switch: atomic
            for old in out.glob("checkpoint-*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)

    def _write_model(self, tmp: Path, named, state: dict, tokenizer_dir: str):
        from transformers import AutoTokenizer

        self.weights.save(tmp, named, self.model, tokenizer_dir)     # (tokenizer_dir: the base model's dir)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        (tmp / "state.json").write_text(json.dumps(state, indent=2))

    def load_optimizer(self, ckpt_dir: str):
        path = Path(ckpt_dir) / f"optimizer.rank{self.rank}.pt"
        if not path.exists():
            raise FileNotFoundError(f"--resume: {path} missing (resume needs the same number of trainer "
                                    f"ranks)")
        # weights_only: a crafted optimizer file must not run code on --resume
        # map_location: straight onto this rank's device, whichever device wrote it
        self.opt.load_state_dict(torch.load(path, weights_only=True, map_location=self.device))


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


def check_run_dir(out_dir: str, resume: str, overwrite: bool, steps: int, train_gpus: int,
                  model: str) -> dict | None:
    """Before any process group or engine starts: does what --out-dir holds fit what was asked?
    Returns the checkpoint state to resume from (None: a fresh run); exits naming the problem."""
    out = Path(out_dir)
    state = read_checkpoint_state(out_dir)
    if resume == "no" or (resume == "auto" and state is None):
        if state is not None and not overwrite:
            sys.exit(f"train.py: --out-dir {out} holds a checkpoint (step {state['step']}): pass --resume "
                     f"to continue it, or --overwrite to start over (its metrics and checkpoint are then "
                     f"replaced)")
        try:                                    # writable? (rank 0 writes; every rank checks, cheaply)
            out.mkdir(parents=True, exist_ok=True)
            probe = out / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            sys.exit(f"train.py: --out-dir {out} cannot be written: {e.strerror}")
        return None
    if state is None:
        sys.exit(f"train.py: --resume: no checkpoint in {out / 'checkpoint'}")
    saved = state.get("config", {})
    if saved.get("train_gpus", train_gpus) != train_gpus:
        sys.exit(f"train.py: --resume: the checkpoint was written by {saved['train_gpus']} trainer ranks "
                 f"(--train-gpus {saved['train_gpus']}); its optimizer is sharded that way, so resume with "
                 f"the same")
    if model and model != saved.get("model", model):
        sys.exit(f"train.py: --resume: --model {model} is not the model this run started from "
                 f"({saved.get('model') or 'the embedded tiny model'}); a resumed run continues its "
                 f"checkpoint")
    if steps <= state["step"]:
        if resume == "auto":      # a restart after the final checkpoint: the run is complete
            print(f"train.py: --resume auto: the checkpoint in {out} is at step {state['step']} >= --steps "
                  f"{steps}: nothing left to do", flush=True)
            sys.exit(0)
        sys.exit(f"train.py: --resume: the checkpoint is at step {state['step']}, so --steps {steps} leaves "
                 f"nothing to do; pass --steps > {state['step']}")
    return state


def check_model_dir(model: str):
    """--model, read before anything starts: a bad one is named with what is wrong."""
    path = Path(model)
    if not path.is_dir():
        sys.exit(f"train.py: --model {path}: no such directory")
    if not (path / "config.json").exists():
        sys.exit(f"train.py: --model {path}: not a Hugging Face model dir (no config.json)")
    try:
        json.loads((path / "config.json").read_text())
    except ValueError as e:
        sys.exit(f"train.py: --model {path}: config.json is not valid JSON ({e})")
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        sys.exit(f"train.py: --model {path}: no weights (*.safetensors or pytorch_model*.bin)")
    try:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        sys.exit(f"train.py: --model {path}: its tokenizer does not load: {e}")
