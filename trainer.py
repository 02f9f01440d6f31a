"""trainer.py: the training side. Model, optimizer, data parallel, logprobs, weight broadcast, checkpoints.

Runs on every trainer rank (torch.distributed group `trainer_group`):

    trainer = Trainer(model_dir, TrainConfig(...), trainer_group)
    metrics = trainer.train_step(samples, advantages, version)   # this rank's shard of the batch
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

A batch is --ppo-epochs passes of --mini-batches optimizer steps (default 1 x 1: one step per
batch). The trainer's logprobs before the batch's first step are computed first when the loss needs
them (decoupled_ppo's proximal policy; --recompute-old-logprobs), and the mean |engine - trainer|
logprob gap is reported per step: over all samples (staleness + numerical mismatch) and over the
on-policy ones alone (mismatch only). Under FSDP every rank runs the same number of micro-batches
(the largest rank's count; a short rank runs empty ones of weight 0), since each is a collective.

Deliberate simplifications:
- With one optimizer step per batch (the default) decoupled PPO's proximal policy is the current
  one and its clip never binds: use --mini-batches or --ppo-epochs > 1 to give it a trust region.
- Mini-batches keep the same samples in every epoch (shuffled once per batch, not per epoch).
- Loss normalisation across micro-batches and ranks: each rank's loss is its local token-mean (or
  seq-mean) and FSDP averages the ranks' gradients, so ranks weigh equally rather than by their
  token counts; with the round-robin batch split the difference is small.
- The optimizer state is saved per trainer rank (its FSDP shards); resuming needs the same number
  of trainer ranks. The model itself is saved whole, in HF format.
"""

import errno
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import losses
from buffer import Sample
from config import flag

EMPTY = Sample("empty", "empty", [0], [0], [0.0], [0], [], 0.0)   # a micro-batch with nothing to learn (FSDP padding)


@dataclass
class TrainConfig:
    loss: str = "ppo"                 # one of losses.VARIANTS
    lr: float = 3e-4                  # AdamW learning rate
    weight_decay: float = 0.0
    grad_clip: float = 1.0            # max global grad norm
    warmup_steps: int = 10            # linear LR warm-up (in batches): Adam's first steps are sign-like and large
    ppo_epochs: int = 1               # passes over each batch
    mini_batches: int = 1             # optimizer steps per pass: the batch is split into this many
    recompute_old_logprobs: bool = False   # old logprobs from the trainer before the update, not the engine's
    # the losses' hyperparameters (losses.compute_policy_loss), each with its paper's default
    clip_low: float = 0.2             # PPO-family ratio clip, lower (PPO: 0.2)
    clip_high: float = 0.28           # PPO-family ratio clip, upper (DAPO's clip-higher: 0.28)
    dual_clip: float = 0.0            # dual-clip PPO's c for A < 0 (Ye et al. 2020 use 3); 0 = off
    behav_weight_cap: float = 0.0     # decoupled_ppo: drop tokens whose pi_prox / mu exceeds this (AReaL); 0 = off
    tis_cap: float = 2.0              # tis: IS weight cap (Yao et al. 2025: 2)
    cispo_low: float = 1.0            # cispo: IS weight >= 1 - this (MiniMax-M1: no lower bound)
    cispo_high: float = 0.28          # cispo: IS weight <= 1 + this (unpublished in MiniMax-M1)
    topr_pos_weight: float = 1.0      # topr: scale of A > 0 tokens (Le Roux et al. 2025: 1)
    topr_neg_weight: float = 1.0      # topr: scale of A <= 0 tokens (Le Roux et al. 2025: 1)
    gspo_clip_low: float = 3e-4       # gspo: sequence-ratio clip, lower (Zheng et al. 2025: 3e-4)
    gspo_clip_high: float = 4e-4      # gspo: sequence-ratio clip, upper (Zheng et al. 2025: 4e-4)
    loss_agg: str = "token-mean"      # token-mean | seq-mean-token-mean
    micro_batch: int = 64             # sequences per forward/backward
    bucket_mb: int = 64               # weight broadcast bucket size, MiB
    seed: int = 0

    def __post_init__(self):
        if self.loss not in losses.VARIANTS:
            raise ValueError(f"--loss {self.loss!r}: must be one of {', '.join(losses.VARIANTS)}")
        if self.lr <= 0 or self.micro_batch < 1 or self.bucket_mb < 1:
            raise ValueError("TrainConfig: lr must be > 0, micro_batch and bucket_mb >= 1")
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError(f"--ppo-epochs and --mini-batches must be >= 1, got {self.ppo_epochs}, {self.mini_batches}")
        for gspo in (False, True):        # the losses' own check, its message naming our flag
            try:
                losses.check_hparams(**self.loss_kwargs(gspo))
            except ValueError as e:
                name, rest = str(e).split(" ", 1)
                name = "loss_agg" if name == "agg" else ("gspo_" + name if gspo and name.startswith("clip") else name)
                raise ValueError(f"{flag(name)} {rest}" + (" (0 = off)" if "None" in rest else "")) from None

    def loss_kwargs(self, gspo: bool | None = None) -> dict:
        """compute_policy_loss's hyperparameters for this config's loss (gspo has its own clip range)."""
        gspo = self.loss == "gspo" if gspo is None else gspo
        return dict(clip_low=self.gspo_clip_low if gspo else self.clip_low,
                    clip_high=self.gspo_clip_high if gspo else self.clip_high, dual_clip=self.dual_clip or None,
                    tis_cap=self.tis_cap, cispo_low=self.cispo_low, cispo_high=self.cispo_high,
                    topr_pos_weight=self.topr_pos_weight, topr_neg_weight=self.topr_neg_weight, agg=self.loss_agg,
                    behav_weight_cap=self.behav_weight_cap or None)


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


def split(items: list, n: int) -> list[list]:
    """n contiguous parts of near-equal size (some empty when len(items) < n)."""
    return [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]


def add_gap(gap: dict, t: dict, trainer_logp: torch.Tensor):
    """Accumulate |engine - trainer| logprob over the micro-batch's response tokens, for all samples
    and for the on-policy ones (gap: {"all": [sum, tokens], "on_policy": [sum, tokens]})."""
    diff = (t["old_logp"] - trainer_logp).abs() * t["mask"]                   # [B, T]
    for key, rows in (("all", torch.ones_like(t["on_policy"])), ("on_policy", t["on_policy"])):
        gap[key][0] += diff[rows].sum().item()
        gap[key][1] += t["mask"][rows].sum().item()


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
        self.num_steps = 0                # batches trained (restored from checkpoints; the LR warm-up counts these)

    # --- training
    def train_step(self, samples, advantages: list[float], version: int | None = None) -> dict:
        """One batch on this rank: ppo_epochs passes over its samples, each pass mini_batches
        optimizer steps. advantages: one per sample (GRPO). version: the policy version these weights
        are (the trainer's, before this batch): samples wholly of that version are on-policy, so their
        engine/trainer logprob gap is numerical mismatch alone (logp_diff_on_policy), not staleness.

        The trainer's logprobs before the first update (`pre`) are computed first, without grad,
        when the loss needs them: decoupled_ppo's proximal policy, frozen for the whole batch (so its
        clip acts from the second optimizer step on), or --recompute-old-logprobs (they replace the
        engine's as the old logprobs). Returns metrics averaged over the optimizer steps (rank 0's:
        each rank reports its own shard); self.update_metrics keeps them per step."""
        cfg = self.cfg
        self.model.train()
        plan = self._plan(samples, advantages, version)     # [mini-batch][micro-batch] -> tensors
        if cfg.loss == "decoupled_ppo" or cfg.recompute_old_logprobs:
            with torch.no_grad():
                for micro in (t for mini in plan for t in mini):
                    micro["pre"] = token_logprobs(self.model, micro["input_ids"], micro["attn"])
        lr = cfg.lr * min(1.0, (self.num_steps + 1) / max(cfg.warmup_steps, 1))
        for g in self.opt.param_groups:
            g["lr"] = lr
        kw = cfg.loss_kwargs()
        gap = {"all": [0.0, 0.0], "on_policy": [0.0, 0.0]}    # sum |logp_engine - logp_trainer|, tokens
        self.update_metrics = []
        for epoch in range(cfg.ppo_epochs):
            for j, mini in enumerate(plan):
                self.opt.zero_grad(set_to_none=True)
                sums: dict[str, float] = {"loss": 0.0}
                for t in mini:
                    logp = token_logprobs(self.model, t["input_ids"], t["attn"])          # [B, T], with grad
                    if epoch == 0 and (j == 0 or "pre" in t):   # trainer logprobs before any update: the gap
                        add_gap(gap, t, t.get("pre", logp.detach()))
                    old = t["pre"] if cfg.recompute_old_logprobs else t["old_logp"]
                    loss, m = losses.compute_policy_loss(logp, old, t["adv"], t["mask"], cfg.loss,
                                                         prox_logp=t.get("pre"), **kw)
                    (loss * t["weight"]).backward()    # weights: the step's loss is the mini-batch's token-mean
                    for k, v in {"loss": loss.item(), **m}.items():
                        sums[k] = sums.get(k, 0.0) + v * t["weight"]
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
                self.opt.step()
                self.update_metrics.append({**sums, "grad_norm": float(grad_norm)})
        self.num_steps += 1
        out = {k: sum(u[k] for u in self.update_metrics) / len(self.update_metrics) for k in self.update_metrics[0]}
        out.update(lr=lr, num_updates=len(self.update_metrics))
        for key, (total, n) in gap.items():
            if n:
                out[f"logp_diff_{key}"] = total / n       # mean |engine - trainer| per response token
        return out

    def _plan(self, samples, advantages, version) -> list[list[dict]]:
        """This rank's samples as mini-batches of collated micro-batches, each with its loss weight.
        Under FSDP every rank must run the same number of forward/backward passes and optimizer steps
        (each is a collective): the counts come from the largest rank's sample count, and a rank
        with too few samples runs an empty micro-batch (one masked token, weight 0) in their place."""
        cfg = self.cfg
        most = len(samples)
        if self.fsdp:
            n = torch.tensor([most], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
            most = int(n.item())
        order = list(range(len(samples)))
        if cfg.mini_batches > 1:      # a batch arrives grouped by prompt: mini-batches mix prompts
            order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(
                cfg.seed * 100_003 + self.num_steps)).tolist()
        num_micro = max(1, math.ceil(math.ceil(most / cfg.mini_batches) / cfg.micro_batch))   # per mini-batch
        plan = []
        for mini in split(order, cfg.mini_batches):
            tokens = sum(sum(samples[i].loss_mask) for i in mini)
            micros = []
            for part in split(mini, num_micro):
                batch = [samples[i] for i in part] or [EMPTY]
                t = collate(batch, self.device)
                t["adv"] = torch.tensor([advantages[i] for i in part] or [0.0], dtype=torch.float32, device=self.device)
                t["on_policy"] = torch.tensor([version is not None and bool(s.versions) and
                                               all(v == version for v in s.versions) for s in batch], device=self.device)
                if not part:
                    t["weight"] = 0.0
                elif cfg.loss_agg == "token-mean":
                    t["weight"] = sum(sum(s.loss_mask) for s in batch) / max(tokens, 1)
                else:
                    t["weight"] = len(part) / len(mini)
                micros.append(t)
            plan.append(micros)
        return plan

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The trainer's logprobs of a probe sequence (collective under FSDP: call on every trainer rank)."""
        self.model.eval()
        ids = torch.tensor([token_ids], device=self.device)
        return token_logprobs(self.model, ids, torch.ones_like(ids))[0, 1:].tolist()

    # --- weights out
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of what the engines load, without gathering (a sharded DTensor knows its
        full shape). A tied lm_head is left out: HF checkpoints don't carry it and engines re-tie it."""
        return [(n, v) for n, v in self.model.state_dict().items() if not (self.tied and n == "lm_head.weight")]

    def iter_full_state(self):
        """(HF name, full tensor on this rank's device), one weight at a time: under FSDP each is one
        all-gather, so the extra memory is one weight, not the model. Collective: every trainer rank
        iterates it to the end, in the same order."""
        for name, v in self.named_weights():
            yield name, (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()

    def full_state(self) -> list[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under their HF names, on CPU (checkpoints). Collective under FSDP."""
        return [(n, t.to("cpu")) for n, t in self.iter_full_state()]

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
