"""losses.py: the off-policy policy-gradient objectives, as pure functions (tensors in, loss out).

    loss, metrics = compute_policy_loss(logp, old_logp, advantages, mask, "ppo", clip_high=0.28)
    adv = estimate_advantages(rewards, group_size=8, estimator="grpo")   # --adv-estimator
    kl, metrics = kl_penalty(logp, ref_logp, mask)     # --kl-coef's term: k3 to a reference, clamped

Tokens come from a behaviour policy mu (`old_logp`), maybe several versions behind the trained pi
(`logp`). Per-token losses (r = exp(logp - old_logp), A = advantage, sg = stop-gradient):

    reinforce      -A logp
    ppo            max(-r A, -clip(r, 1-clip_low, 1+clip_high) A); dual_clip c: for A < 0, min(that, -c A)
    decoupled_ppo  w * [ppo with r' = pi / pi_prox], w = sg(pi_prox / mu); 0 where w > behav_weight_cap
    tis            -sg(min(r, tis_cap)) A logp
    cispo          -sg(clip(r, 1-cispo_low, 1+cispo_high)) A logp
    topr           A > 0: -topr_pos_weight A logp; A <= 0: -topr_neg_weight sg(clip(r, 0, 1)) A logp
    gspo           ppo per sequence on s = exp(masked mean of logp - old_logp), A = sequence advantage

`agg` is "token-mean" or "seq-mean-token-mean" over unmasked tokens (--loss-agg auto: the latter for
gspo, as its paper, the former for the others). Metrics: clip_frac, ratio_mean,
ratio_max, is_weight_mean, behav_capped_frac, approx_kl (k3 estimate of KL(mu || pi)).

A loss declares its own hyperparameters beside it, @loss(hparams=TisParams): a dataclass whose fields are
flags (LossConfig.hparams) and keywords of compute_policy_loss; Terms.hp holds them and PPO's shared
clip_low, clip_high, dual_clip. Per-token values reach a loss by name (fields=, Terms.fields): each
token's policy version and lag (versions behind the trainer), and each entry of Sample.token_fields.
ADV_SHAPERS turn the per-sample advantage into per-token ones from those (the trainer, per micro-batch).

Rollout correction, on top of any loss (--is-correction; rollout_correction(), the verl/slime style):
rho = pi_prox / mu per token, or per sequence (the product over its tokens), with pi_prox the trainer
before this update; the loss then takes pi_prox as its own reference instead of mu, and each token's
loss is multiplied by w: tis min(rho, cap); mis rho inside [1/cap, cap], else 0; icepop 1 inside
[icepop_low, icepop_high], else 0. decoupled_ppo's own weight pi_prox / mu is replaced by w, so ppo + X
and decoupled_ppo + X are one objective. The tis loss above stays what it is (truncated-IS REINFORCE
against mu); ppo + --is-correction tis is the field's TIS (PPO against pi_prox, times the truncated
pi_prox / mu).

ref_prox (--recompute-old-logprobs): every formula's mu above becomes pi_prox (verl's recomputed
old_log_prob), except decoupled_ppo's, which has both roles already (pi_prox in the clip, mu in w). mu
then enters only through decoupled_ppo's w or a correction's weight; a correction implies ref_prox.

Main deviations (all of them, and the full table, in DESIGN.md): log-ratios clamped to [-20, 20];
tis is truncated-IS REINFORCE, not on top of PPO; topr's ratio and sign split are per token;
cispo's defaults are ours; gspo's paper clip range is far tighter than the shared defaults.

Design notes: DESIGN.md#lossespy
"""

import dataclasses
import functools
import types
from dataclasses import dataclass

import torch

from config import check, opt, registry

CORRECTIONS = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence")
AGG_MODES = ("token-mean", "seq-mean-token-mean")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8, finite in the float32 (or float64) the math runs in


# --- advantage estimators: rewards of consecutive groups of group_size samples (one prompt's) -> one
# advantage per sample. A new one: a function (rewards [N], group_size) -> [N], and its entry in
# ADV_ESTIMATORS; --adv-estimator picks it. The streaming trainer calls it on one group at a time, as the
# groups complete, so an estimator that needs the whole batch (a batch-wide std) would not stream exactly.

def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-baseline advantages: rewards [N] -> [N], each reward minus its group's mean, divided by the
    group's std + eps when `scale` (grpo; drgrpo without). Groups are consecutive runs of `group_size`
    rewards (the samples of one prompt). The std is the population std (divide by G, not G - 1): it is
    defined for group_size 1 (advantage 0), and equals TRL's / verl's unbiased std times
    sqrt((G - 1) / G). A group with equal rewards gets advantage 0."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(f"number of rewards {n} is not a multiple of group_size {group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    g = rewards.view(-1, group_size)                               # [N / G, G]
    adv = g - g.mean(-1, keepdim=True)
    if scale:
        adv = adv / (g.std(-1, correction=0, keepdim=True) + eps)
    return adv.reshape(n)


# grpo (Shao et al. 2024): each reward minus its group's mean, over the group's std + 1e-6. drgrpo (Dr. GRPO,
# Liu et al. 2025): each reward minus its group's mean, unscaled (the std's division weighs groups of nearly
# equal rewards up; its other change, a length-free aggregation, is not here).
ADV_ESTIMATORS = {"grpo": functools.partial(group_advantages, scale=True),
                  "drgrpo": functools.partial(group_advantages, scale=False)}


def estimate_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo") -> torch.Tensor:
    """rewards [N] -> advantages [N] by the estimator registered under that name (--adv-estimator)."""
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"--adv-estimator {estimator!r}: known: {', '.join(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[estimator](rewards, group_size)


# --- the policy losses: a function (Terms) -> (per-token loss [B, T], its extras), and its entry in LOSSES;
# --loss picks one. Extras (all optional, [B, T]): "clipped" (bool, for clip_frac), "is_w" (the stop-gradient
# weight it applied, for is_weight_mean), "capped" (bool, tokens it dropped). A loss marked needs_prox gets
# the trainer's own logprobs before the update (prox); own_correction: it applies --is-correction's weight
# itself (corr_w) and keeps mu as `old` under --recompute-old-logprobs. hparams: the dataclass of its own
# hyperparameters (opt fields: each one a flag, and a keyword of compute_policy_loss; it checks them in
# __post_init__), declared beside it; Terms.hp holds them and the shared ones (PPO's clip_low, clip_high,
# dual_clip: LossConfig's).

class Fields(dict):
    """Per-token values by name, each [B, T], 0 where masked (Terms.fields, and a trainer micro-batch's
    "fields"). A batch with no token to learn from (the FSDP padding, model.EMPTY) carries none of the
    samples' names, so any name reads as zeros there; elsewhere a missing name is a KeyError naming it."""

    def __init__(self, values: dict, mask: torch.Tensor):
        super().__init__(values)
        self.mask = mask

    def __missing__(self, name):
        if (self.mask != 0).any():
            have = ", ".join(self) or "none"
            raise KeyError(f"no per-token field {name!r} in this batch (it has {have}): a sample's come from "
                           f"its token_fields; lag needs the trainer's version")
        return torch.zeros(self.mask.shape, device=self.mask.device)


@dataclass
class Terms:
    """What a loss sees: float32 (at least) [B, T], zero where masked. r = exp(lp - old), clamped."""
    lp: torch.Tensor            # log pi, with grad
    old: torch.Tensor           # the ratio's old policy: mu (the engine), or pi_prox (corrected / recomputed)
    prox: torch.Tensor | None   # pi_prox: the trainer before this update (when needed)
    r: torch.Tensor             # pi / old
    A: torch.Tensor             # advantages, per token
    m: torch.Tensor             # the mask, bool
    corr_w: torch.Tensor | None  # --is-correction's weight (None: no correction)
    hp: dict                    # the shared hyperparameters and the loss's own (compute_policy_loss's)
    fields: Fields              # per-token values by name: version, lag, and every Sample.token_fields entry
    version = property(lambda t: t.fields["version"])   # the policy version that sampled each token
    lag = property(lambda t: t.fields["lag"])   # versions each is behind the trainer (train_step's version)


def loss(needs_prox: bool = False, own_correction: bool = False, hparams: type | None = None):
    """Mark a loss function (or an advantage shaper: hparams alone) with what it needs (see above)."""
    def mark(fn):
        fn.needs_prox, fn.own_correction, fn.hparams = needs_prox, own_correction, hparams
        return fn
    return mark


@loss()
def reinforce(t: Terms):
    return -t.A * t.lp, {}


@loss()
def ppo(t: Terms):
    loss_tok, clipped = _ppo_clip(t.r, t.A, t.hp["clip_low"], t.hp["clip_high"], t.hp["dual_clip"])
    return loss_tok, {"clipped": clipped}


@dataclass
class DecoupledParams:
    behav_weight_cap: float = opt(0.0, "decoupled_ppo: drop tokens whose pi_prox / mu exceeds this (AReaL); "
                                       "0 = off")

    def __post_init__(self):
        check(self, at_least=dict(behav_weight_cap=0))


@loss(needs_prox=True, own_correction=True, hparams=DecoupledParams)
def decoupled_ppo(t: Terms):
    is_w = (t.corr_w if t.corr_w is not None                                        # the correction's, or
            else (t.prox - t.old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp())   # w = pi_prox / mu
    r_prox = (t.lp - t.prox).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()        # r' = pi / pi_prox
    inner, clipped = _ppo_clip(r_prox, t.A, t.hp["clip_low"], t.hp["clip_high"], t.hp["dual_clip"])
    capped = torch.zeros_like(t.m)
    if t.hp["behav_weight_cap"]:
        capped = t.m & (is_w > t.hp["behav_weight_cap"])
        is_w = torch.where(capped, 0.0, is_w)
    return is_w * inner, {"clipped": clipped, "is_w": is_w, "capped": capped}


@dataclass
class TisParams:
    tis_cap: float = opt(2.0, "tis: importance weight cap (Yao et al. 2025)")

    def __post_init__(self):
        check(self, above=dict(tis_cap=0))


@loss(hparams=TisParams)
def tis(t: Terms):
    is_w = t.r.detach().clamp(max=t.hp["tis_cap"])
    return -is_w * t.A * t.lp, {"clipped": t.r > t.hp["tis_cap"], "is_w": is_w}


@dataclass
class CispoParams:
    cispo_low: float = opt(1.0, "cispo: IS weight >= 1 - this (1 = no lower bound, MiniMax-M1)")
    cispo_high: float = opt(0.28, "cispo: IS weight <= 1 + this (MiniMax-M1 does not publish it)")

    def __post_init__(self):
        check(self, at_least=dict(cispo_low=0, cispo_high=0))


@loss(hparams=CispoParams)
def cispo(t: Terms):
    lo, hi = 1.0 - t.hp["cispo_low"], 1.0 + t.hp["cispo_high"]
    is_w = t.r.detach().clamp(lo, hi)
    return -is_w * t.A * t.lp, {"clipped": (t.r < lo) | (t.r > hi), "is_w": is_w}


@dataclass
class ToprParams:
    topr_pos_weight: float = opt(1.0, "topr: weight of A > 0 tokens (Le Roux et al. 2025)")
    topr_neg_weight: float = opt(1.0, "topr: weight of A <= 0 tokens (Le Roux et al. 2025)")

    def __post_init__(self):
        check(self, at_least=dict(topr_pos_weight=0, topr_neg_weight=0))


@loss(hparams=ToprParams)
def topr(t: Terms):
    pos = t.A > 0                                                    # [B, T]
    is_w = torch.where(pos, 1.0, t.r.detach().clamp(max=1.0))        # clip(r, 0, 1); r > 0 already
    scale = torch.where(pos, torch.full_like(t.A, t.hp["topr_pos_weight"]), t.hp["topr_neg_weight"])
    return -scale * is_w * t.A * t.lp, {"clipped": ~pos & (t.r > 1.0), "is_w": is_w}


@dataclass
class GspoParams:
    gspo_clip_low: float = opt(3e-4, "gspo: sequence ratio >= 1 - this (Zheng et al. 2025)")
    gspo_clip_high: float = opt(4e-4, "gspo: sequence ratio <= 1 + this (Zheng et al. 2025)")

    def __post_init__(self):
        check(self, at_least=dict(gspo_clip_low=0, gspo_clip_high=0), at_most=dict(gspo_clip_low=1))


@loss(hparams=GspoParams)
def gspo(t: Terms):
    n = t.m.sum(-1).clamp(min=1).to(t.lp.dtype)                      # [B] unmasked tokens per sequence
    log_s = ((t.lp - t.old).sum(-1) / n).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    A_seq = t.A.sum(-1) / n                                          # [B] masked token-mean advantage
    loss_seq, clipped_seq = _ppo_clip(log_s.exp(), A_seq, t.hp["gspo_clip_low"], t.hp["gspo_clip_high"], None)
    # each token carries its sequence's loss
    return loss_seq[:, None].expand_as(t.lp), {"clipped": clipped_seq[:, None].expand_as(t.m)}


LOSSES = {"reinforce": reinforce, "ppo": ppo, "decoupled_ppo": decoupled_ppo, "tis": tis, "cispo": cispo,
          "topr": topr, "gspo": gspo}
VARIANTS = tuple(LOSSES)     # (the registry's names, in --loss's help order; more may be registered)

# --- per-token advantages: ADV_SHAPERS, name -> shaper (mb, params) -> advantages [B] or [B, T]. The
# trainer calls every shaper, in order, on each micro-batch mb before its loss (train_step and the streamed
# GradStream alike: both go through Trainer.micro): mb["adv"] (the sample's advantage [B], or an earlier
# shaper's [B, T]), mb["old_logp"], mb["mask"] and mb["fields"] ([B, T]). params: its hyperparameters (marked
# @loss(hparams=...), flags like a loss's: LossConfig.hparams[name]), or None; a shaper that is off returns
# mb["adv"] as it is.
ADV_SHAPERS: dict = {}

SHARED = dict(clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean", is_correction="none",
              is_level="token", is_cap=2.0, icepop_low=0.5, icepop_high=5.0)
# compute_policy_loss's shared keywords and their defaults: PPO's clip range (ratio in [1 - clip_low, 1 +
# clip_high]) and dual clip (for A < 0 the loss is at most -dual_clip A; None or 0: off), the aggregation,
# and the rollout correction (needs prox_logp): its mode, level, tis/mis cap and icepop's band.
# LossConfig's fields of these names (loss_agg for agg) are the flags.


@dataclass
class LossConfig:
    """--loss and compute_policy_loss's shared hyperparameters, one field (one --flag) each, named as its
    keyword (except: loss_agg is agg; 0 = off). A loss's (or an advantage shaper's) own hyperparameters are
    its @loss(hparams=...) dataclass's fields, flags too: hparams[name]."""
    loss: str = opt("ppo", "the policy loss: " + " | ".join(VARIANTS) + " (losses.LOSSES, formulas)")
    clip_low: float = opt(0.2, "ppo, decoupled_ppo: ratio >= 1 - this (PPO's epsilon)")
    clip_high: float = opt(0.28, "ppo, decoupled_ppo: ratio <= 1 + this (DAPO's clip-higher)")
    dual_clip: float = opt(0.0, "ppo, decoupled_ppo: dual clip c for A < 0 (Ye et al. 2020: 3); 0 = off")
    loss_agg: str = opt("auto", "loss aggregation: " + " | ".join(AGG_MODES) + " | auto (each loss's own: "
                                "seq-mean-token-mean for gspo, as its paper; token-mean for the others)")
    adv_estimator: str = opt("grpo", "advantages from each group's rewards: " + " | ".join(ADV_ESTIMATORS)
                             + " (losses.ADV_ESTIMATORS: grpo = (r - group mean) / (group std + eps); "
                             "drgrpo = r - group mean, unscaled, Dr. GRPO's)")
    is_correction: str = opt("none", "rollout correction on top of --loss, weight from pi_prox / mu (the "
                                     "trainer before the update / the engine): " + " | ".join(CORRECTIONS))
    is_level: str = opt("token", "rollout correction's ratio: per token, or per sequence (the product)")
    is_cap: float = opt(2.0, "--is-correction tis: weight <= this; mis: kept inside [1/this, this] "
                             "(Yao et al. 2025: 2)")
    icepop_low: float = opt(0.5, "--is-correction icepop: tokens with ratio below this get no gradient")
    icepop_high: float = opt(5.0, "--is-correction icepop: tokens with ratio above this get no gradient")
    kl_coef: float = opt(0.0, "KL penalty to the initial model (k3, clamped: kl_penalty) times this, "
                              "added to the loss; 0 = off, and no reference model is loaded")
    hparams: dict = registry(lambda: {n: f.hparams for n, f in (LOSSES | ADV_SHAPERS).items()
                                      if getattr(f, "hparams", None)})

    def __post_init__(self):
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(f"--adv-estimator {self.adv_estimator!r}: known: {', '.join(ADV_ESTIMATORS)}")
        check(self, at_least=dict(kl_coef=0), below=dict(kl_coef=float("inf")),
              one_of=dict(loss_agg=(*AGG_MODES, "auto"), loss=tuple(LOSSES)))
        check_hparams(**{n: getattr(self, n) for n in SHARED if n != "agg"}, agg=self.agg)

    @property
    def agg(self) -> str:
        """--loss-agg, auto resolved for this config's loss (gspo: per sequence; the others: per token)."""
        if self.loss_agg != "auto":
            return self.loss_agg
        return "seq-mean-token-mean" if self.loss == "gspo" else "token-mean"

    def loss_kwargs(self) -> dict:
        """compute_policy_loss's keywords for this config's loss: the shared ones and the loss's own."""
        own = self.hparams.get(self.loss)
        return {**{n: getattr(self, n) for n in SHARED if n != "agg"}, "agg": self.agg,
                **(dataclasses.asdict(own) if own else {})}


def compute_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, variant: str, *, prox_logp: torch.Tensor | None = None,
                        fields: dict | None = None, ref_prox: bool = False,
                        **hparams) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss to minimise (its gradient through logp) and float metrics.

    logp [B, T]: pi's log-probs of the sampled tokens, with grad; old_logp [B, T]: mu's, the engine's;
    advantages [B] (per sequence) or [B, T] (per token); mask [B, T]: 1 on the tokens that count;
    prox_logp [B, T]: pi_prox, the trainer before this update (decoupled_ppo, a correction, ref_prox);
    fields: name -> [B, T] per-token values (Terms.fields); ref_prox: the ratio's old policy is pi_prox,
    not mu (--recompute-old-logprobs); hparams: SHARED's (defaults there) and the loss's own."""
    fn, hp = _hparams(variant, hparams)
    t, mu, corrected = _terms(fn, hp, logp, old_logp, advantages, mask, prox_logp, fields or {}, ref_prox)
    loss_tok, extra = fn(t)                                        # [B, T]: the loss's own formula
    if t.corr_w is not None and not fn.own_correction:
        loss_tok = t.corr_w * loss_tok                             # the rollout correction's weight
    loss = _aggregate(torch.where(t.m, loss_tok, 0.0), t.m, hp["agg"])
    return loss, _metrics(t, mu, extra, corrected)


def _hparams(variant: str, given: dict) -> tuple:
    """(the loss, its hyperparameters: the shared ones and its own, checked)."""
    if variant not in LOSSES:
        raise ValueError(f"unknown variant {variant!r}; valid variants: {', '.join(LOSSES)}")
    fn = LOSSES[variant]
    declared = {f.name for g in LOSSES.values() if g.hparams for f in dataclasses.fields(g.hparams)}
    if unknown := [k for k in given if k not in declared and k not in SHARED]:
        raise TypeError(f"compute_policy_loss() got an unexpected keyword argument {unknown[0]!r}")
    mine = {f.name for f in dataclasses.fields(fn.hparams)} if fn.hparams else ()
    own = dataclasses.asdict(fn.hparams(**{k: given[k] for k in mine if k in given})) if fn.hparams else {}
    hp = {**SHARED, **{k: v for k, v in given.items() if k in SHARED}, **own}
    check_hparams(**{k: hp[k] for k in SHARED})
    return fn, hp


def _terms(fn, hp: dict, logp, old_logp, advantages, mask, prox_logp, fields: dict, ref_prox: bool):
    """The loss's inputs (Terms): [B, T], float32 at least, zeroed where masked before any arithmetic, so
    nothing there reaches the loss or its gradient. Also mu (the engine's log-probs, for approx_kl) and the
    tokens the rollout correction changed (None: no correction)."""
    _check_shapes(logp, old_logp, advantages, mask, prox_logp, fields)
    correct = hp["is_correction"] != "none"
    if (fn.needs_prox or correct or ref_prox) and prox_logp is None:
        who = (f"--is-correction {hp['is_correction']}" if correct else "ref_prox=True" if ref_prox
               else f"variant {fn.__name__}")
        raise ValueError(f"{who} needs prox_logp= (the trainer's logprobs of the sampled tokens under the "
                         f"weights before this update)")
    m = mask != 0                                                  # [B, T] bool
    dt = torch.promote_types(logp.dtype, torch.float32)            # bf16 / fp16 inputs: math in fp32

    def masked(x):
        return torch.where(m, x.to(dt), 0.0)

    lp, mu = masked(logp), masked(old_logp.detach())
    adv = advantages.detach()
    A = masked(adv[:, None] if adv.dim() == 1 else adv)           # [B, T]
    prox = masked(prox_logp.detach()) if prox_logp is not None else None
    corr_w = corrected = None
    if correct:      # the correction covers mu -> pi_prox, the loss pi_prox -> pi
        corr_w, corrected = rollout_correction(prox, mu, m, hp["is_correction"], hp["is_level"], hp["is_cap"],
                                               hp["icepop_low"], hp["icepop_high"])
    # the ratio's old policy: pi_prox when corrected or recomputed (decoupled_ppo: both roles, its own)
    old = prox if correct or (ref_prox and not fn.own_correction) else mu
    r = (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [B, T] pi / old
    per_token = Fields({k: masked(v.detach()) for k, v in fields.items()}, m)
    return Terms(lp, old, prox, r, A, m, corr_w, hp, per_token), mu, corrected


@torch.no_grad()
def _metrics(t: Terms, mu: torch.Tensor, extra: dict, corrected) -> dict[str, float]:
    """Masked means over the batch of what the loss reported (extra: clipped, is_w, capped) and the ratios;
    approx_kl is k3's KL(mu || pi) with mu the engine's, also when corrected."""
    m, r, count = t.m, t.r, t.m.sum().clamp(min=1)

    def mean(x):
        return (torch.where(m, x.to(r.dtype), 0.0).sum() / count).item()

    def most(x):
        return torch.where(m, x, 0.0).max().item() if m.numel() else 0.0

    log_r_mu = (t.lp - mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)     # [B, T] log pi / mu
    out = {"clip_frac": mean(extra.get("clipped", torch.zeros_like(m))), "ratio_mean": mean(r),
           "ratio_max": most(r), "is_weight_mean": mean(extra.get("is_w", torch.ones_like(r))),
           "approx_kl": mean(log_r_mu.exp() - 1.0 - log_r_mu),
           "behav_capped_frac": mean(extra.get("capped", torch.zeros_like(m)))}
    if corrected is not None:   # k3 of KL(mu || pi_prox): the engine/trainer mismatch, staleness included
        mismatch = (t.prox - mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        out.update(mismatch_kl=mean(mismatch.exp() - 1.0 - mismatch), is_corrected_frac=mean(corrected),
                   is_weight_max=most(t.corr_w))
    return out


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
               clamp: float = 10.0) -> tuple[torch.Tensor, dict[str, float]]:
    """KL(pi || pi_ref) per token from pi's own samples, as a loss (the gradient through logp), verl's
    "low_var_kl": the k3 estimator exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased under pi), with the
    log-ratio clamped to [-20, 20] and the estimate to [-clamp, clamp] (verl's 10). logp, ref_logp, mask:
    [B, T]; aggregated over the mask like the policy loss (`agg`). Metric `kl`: its token mean."""
    if logp.dim() != 2 or ref_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, ref_logp and mask must be [B, T] alike, got {tuple(logp.shape)}, "
                         f"{tuple(ref_logp.shape)}, {tuple(mask.shape)}")
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {', '.join(AGG_MODES)}, got {agg!r}")
    m = mask != 0                                                  # [B, T]
    dt = torch.promote_types(logp.dtype, torch.float32)
    log_r = torch.where(m, ref_logp.detach().to(dt) - logp.to(dt), 0.0)          # [B, T] log pi_ref / pi
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = torch.where(m, (log_r.exp() - log_r - 1.0).clamp(-clamp, clamp), 0.0)   # [B, T]
    with torch.no_grad():
        mean = (kl.sum() / m.sum().clamp(min=1)).item()
    return _aggregate(kl, m, agg), {"kl": mean}


def rollout_correction(prox: torch.Tensor, old: torch.Tensor, m: torch.Tensor, mode: str,
                       level: str = "token", cap: float = 2.0, low: float = 0.5, high: float = 5.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """prox, old: [B, T] logprobs of pi_prox and mu (zero where masked), m: [B, T] bool. Returns the
    weight w [B, T] (no grad; 0 where masked) and the tokens it corrected (bool: truncated by tis, dropped
    by mis or icepop). rho = pi_prox / mu per token, or per sequence exp(sum of its tokens' log-ratios)
    given to each of its tokens."""
    log_rho = torch.where(m, prox - old, 0.0)                      # [B, T]
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()   # [B, T]
    if mode == "tis":                                              # truncated (Yao et al. 2025)
        return torch.where(m, rho.clamp(max=cap), 0.0), m & (rho > cap)
    lo, hi = (1.0 / cap, cap) if mode == "mis" else (low, high)
    kept = m & (rho >= lo) & (rho <= hi)
    # mis: masked IS (rho where kept); icepop: a two-sided mask without reweighting (1 where kept)
    return torch.where(kept, rho if mode == "mis" else torch.ones_like(rho), 0.0), m & ~kept


def _ppo_clip(ratio, A, clip_low, clip_high, dual_clip):
    """PPO clipped loss, elementwise (any shape): returns (loss, clipped bool)."""
    unclipped = -ratio * A
    clipped_term = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * A
    loss = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    if dual_clip:
        dual = (A < 0) & (loss > -dual_clip * A)                   # bound the loss of A < 0 at -c A
        loss = torch.where(dual, -dual_clip * A, loss)
        clipped = clipped | dual
    return loss, clipped


def _aggregate(loss_tok, m, agg):
    """loss_tok [B, T] (zero where masked), m [B, T] bool -> scalar: a sum divided by agg_count(m, agg)."""
    if agg == "token-mean":
        return loss_tok.sum() / m.sum().clamp(min=1)
    n = m.sum(-1)                                                  # [B] tokens per sequence
    seq_loss = loss_tok.sum(-1) / n.clamp(min=1)                   # [B] token mean per sequence
    return seq_loss.sum() / (n > 0).sum().clamp(min=1)             # mean over non-empty sequences


def agg_count(mask: torch.Tensor, agg: str) -> int:
    """What `agg` divides a batch's summed loss by: mask [B, T]'s unmasked tokens (token-mean) or its
    sequences with at least one (seq-mean-token-mean). The loss of a part of the batch (a micro-batch, a
    rank's share) times its count, summed over the parts and divided by their total count, is the whole
    batch's loss: how the trainer weighs micro-batches and ranks."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {', '.join(AGG_MODES)}, got {agg!r}")
    m = mask != 0
    return int(m.sum() if agg == "token-mean" else m.any(-1).sum())


def check_hparams(clip_low, clip_high, dual_clip, is_correction, is_level, is_cap, icepop_low, icepop_high,
                  agg):
    """compute_policy_loss's shared hyperparameters, checked (ValueError naming the flag); a loss's own are
    checked by its hparams dataclass."""
    hp = types.SimpleNamespace(**locals(), loss_agg=agg)                  # (as their flags are named)
    above = dict(is_cap=1, icepop_high=1, **({"dual_clip": 1} if dual_clip else {}))  # dual_clip 0, None: off
    check(hp, above=above, at_least=dict(clip_low=0, clip_high=0, icepop_low=0), at_most=dict(clip_low=1),
          below=dict(icepop_low=1),
          one_of=dict(loss_agg=AGG_MODES, is_correction=CORRECTIONS, is_level=LEVELS))


def _check_shapes(logp, old_logp, advantages, mask, prox_logp, fields):
    if logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(f"logp must be a floating [B, T] tensor, got {logp.dtype} {tuple(logp.shape)}")
    shape = logp.shape
    named = {"old_logp": old_logp, "mask": mask, "prox_logp": prox_logp, **{f"fields[{k!r}]": v
                                                                             for k, v in fields.items()}}
    for name, x in named.items():
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} like logp")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected "
                         f"{tuple(shape[:1])} or {tuple(shape)}")
