"""Tests for losses.py: every objective against its formula, written out here independently.

The reference below works element by element on Python floats (math.exp, min, max) and uses the
analytic derivative of each per-token loss with respect to logp, so both the loss value and the
autograd gradient of losses.py are checked against hand-derived math, not against its own code.
"""

import dataclasses
import math

import pytest
import torch

from config import flag
from losses import VARIANTS, compute_policy_loss, group_advantages

pytestmark = pytest.mark.fast

AGGS = ("token-mean", "seq-mean-token-mean")

# Defaults restated here (not imported) so that a silent change of a default fails a test.
DEFAULTS = dict(clip_low=0.2, clip_high=0.2, dual_clip=None, tis_cap=2.0, cispo_low=1.0,
                cispo_high=0.28, topr_pos_weight=1.0, topr_neg_weight=1.0, behav_weight_cap=0.0,
                gspo_clip_low=3e-4, gspo_clip_high=4e-4)
# Non-default values, to check that each hyperparameter reaches its formula.
CUSTOM = {
    "reinforce": {},
    "ppo": dict(clip_low=0.1, clip_high=0.3, dual_clip=2.0),
    "decoupled_ppo": dict(clip_low=0.15, clip_high=0.25, dual_clip=1.5, behav_weight_cap=1.3),
    "tis": dict(tis_cap=1.2),
    "cispo": dict(cispo_low=0.2, cispo_high=0.3),
    "topr": dict(topr_pos_weight=0.7, topr_neg_weight=1.6),
    "gspo": dict(gspo_clip_low=0.05, gspo_clip_high=0.08),
}


# ---------------------------------------------------------------------------------------------
# reference, element by element


def ppo_token(r, a, lo, hi, dual):
    """PPO loss of one token and its derivative with respect to the ratio r."""
    rc = min(max(r, 1 - lo), 1 + hi)
    loss, dloss_dr, clipped = -r * a, -a, False
    if -rc * a > loss:
        loss, dloss_dr, clipped = -rc * a, 0.0, True
    if dual is not None and a < 0 and -dual * a < loss:
        loss, dloss_dr, clipped = -dual * a, 0.0, True
    return loss, dloss_dr, clipped


def ref_token(variant, lp, olp, plp, a, hp):
    """(loss, dloss/dlogp, clip active, IS weight) of one token, for the per-token variants."""
    r = math.exp(lp - olp)
    if variant == "reinforce":
        return -a * lp, -a, False, 1.0
    if variant == "ppo":
        loss, d_dr, c = ppo_token(r, a, hp["clip_low"], hp["clip_high"], hp["dual_clip"])
        return loss, d_dr * r, c, 1.0  # dr/dlogp = r
    if variant == "decoupled_ppo":
        w, rp = math.exp(plp - olp), math.exp(lp - plp)
        loss, d_dr, c = ppo_token(rp, a, hp["clip_low"], hp["clip_high"], hp["dual_clip"])
        if hp["behav_weight_cap"] and w > hp["behav_weight_cap"]:
            return 0.0, 0.0, c, 0.0          # AReaL: a token whose behaviour weight is too large is dropped
        return w * loss, w * d_dr * rp, c, w
    if variant == "tis":
        w = min(r, hp["tis_cap"])
        return -w * a * lp, -w * a, r > hp["tis_cap"], w
    if variant == "cispo":
        lo, hi = 1 - hp["cispo_low"], 1 + hp["cispo_high"]
        w = min(max(r, lo), hi)
        return -w * a * lp, -w * a, not lo <= r <= hi, w
    if variant == "topr":
        if a > 0:
            k = hp["topr_pos_weight"]
            return -k * a * lp, -k * a, False, 1.0
        k, w = hp["topr_neg_weight"], min(r, 1.0)
        return -k * w * a * lp, -k * w * a, r > 1.0, w
    raise AssertionError(variant)


def ref_weights(mask, agg):
    """weight[b][t] of each token's loss in the aggregate."""
    B, T = len(mask), len(mask[0])
    n_tok = sum(map(sum, mask))
    n_seq = sum(1 for row in mask if sum(row) > 0)
    W = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if mask[b][t]:
                W[b][t] = 1 / n_tok if agg == "token-mean" else 1 / (sum(mask[b]) * n_seq)
    return W


def reference(variant, logp, old, prox, adv, mask, agg, hp):
    """Loss, gradient [B][T], metrics of the whole batch, from the formulas."""
    logp, old, prox, adv, mask = (x.tolist() for x in (logp, old, prox, adv, mask))
    B, T = len(mask), len(mask[0])
    W = ref_weights(mask, agg)
    A = [[a] * T for a in adv] if not isinstance(adv[0], list) else adv
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    clipped, isw = {}, {}
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        if variant == "gspo":
            if not idx:
                continue
            n = len(idx)
            s = math.exp(sum(logp[b][t] - old[b][t] for t in idx) / n)
            a = sum(A[b][t] for t in idx) / n
            l_seq, d_ds, c = ppo_token(s, a, hp["gspo_clip_low"], hp["gspo_clip_high"], None)
            for t in idx:  # every token carries the sequence loss; ds/dlogp_t = s / n
                loss += W[b][t] * l_seq
                grad[b][t] = sum(W[b][u] for u in idx) * d_ds * s / n
                clipped[b, t], isw[b, t] = c, 1.0
            continue
        for t in idx:
            l, d, c, w = ref_token(variant, logp[b][t], old[b][t], prox[b][t], A[b][t], hp)
            loss += W[b][t] * l
            grad[b][t] = W[b][t] * d
            clipped[b, t], isw[b, t] = c, w
    toks = list(clipped)
    ratios = [math.exp(logp[b][t] - old[b][t]) for b, t in toks]
    metrics = {
        "clip_frac": sum(clipped.values()) / len(toks),
        "ratio_mean": sum(ratios) / len(toks),
        "ratio_max": max(ratios),
        "is_weight_mean": sum(isw.values()) / len(toks),
        "approx_kl": sum(r - 1 - math.log(r) for r in ratios) / len(toks),
        "behav_capped_frac": sum(variant == "decoupled_ppo" and hp["behav_weight_cap"] > 0
                                 and math.exp(prox[b][t] - old[b][t]) > hp["behav_weight_cap"]
                                 for b, t in toks) / len(toks),
    }
    return loss, grad, metrics


def make_batch(seed, adv_per_token, B=6, T=9):
    """Random float64 batch. Row 2 is fully masked; ratios spread enough to hit every clip."""
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logp + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    prox = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).to(torch.float64)
    mask[2] = 0
    mask[:, 0] = torch.where(torch.arange(B) == 2, 0.0, 1.0).double()  # other rows non-empty
    shape = (B, T) if adv_per_token else (B,)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    return logp, old, prox, adv, mask


def run(variant, logp, old, prox, adv, mask, **hp):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(logp, old, adv, mask, variant, prox_logp=prox, **hp)
    loss.backward()
    return loss, logp.grad, metrics


# ---------------------------------------------------------------------------------------------
# formulas


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("adv_per_token", [False, True])
@pytest.mark.parametrize("hp_set", ["default", "custom"])
def test_loss_grad_and_metrics_match_formula(variant, agg, adv_per_token, hp_set):
    seed = 10 * VARIANTS.index(variant) + 2 * AGGS.index(agg) + adv_per_token
    logp, old, prox, adv, mask = make_batch(seed, adv_per_token)
    hp = dict(DEFAULTS, **(CUSTOM[variant] if hp_set == "custom" else {}))
    passed = CUSTOM[variant] if hp_set == "custom" else {}
    loss, grad, metrics = run(variant, logp, old, prox, adv, mask, agg=agg, **passed)
    ref_loss, ref_grad, ref_metrics = reference(variant, logp, old, prox, adv, mask, agg, hp)

    assert loss.dim() == 0 and loss.dtype == torch.float64
    assert loss.item() == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64),
                               rtol=1e-10, atol=1e-12)
    assert torch.all(grad[mask == 0] == 0)
    for k, v in ref_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "reinforce"])
def test_random_batch_exercises_both_sides_of_the_clip(variant):
    # Guards the formula test above: with its data and custom hparams, every variant's clip or
    # truncation is active on some tokens and inactive on others.
    logp, old, prox, adv, mask = make_batch(seed=1, adv_per_token=False)
    _, _, metrics = run(variant, logp, old, prox, adv, mask, **CUSTOM[variant])
    assert 0 < metrics["clip_frac"] < 1


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("adv_per_token", [False, True])
def test_on_policy_gradient_is_reinforce(variant, agg, adv_per_token):
    logp, _, _, adv, mask = make_batch(seed=7, adv_per_token=adv_per_token)
    _, grad, _ = run(variant, logp, logp, logp, adv, mask, agg=agg)
    _, reinforce_grad, _ = run("reinforce", logp, logp, logp, adv, mask, agg=agg)
    # independent: d/dlogp of the aggregate of -A logp is -A times the token's aggregation weight
    A = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    if variant == "gspo" and adv_per_token:
        # GSPO uses one advantage per sequence: the masked mean of the token advantages, so its
        # on-policy gradient is REINFORCE's with each sequence's tokens given that mean.
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        A = ((A * mask).sum(-1, keepdim=True) / n).expand_as(A)
    expected = -A * torch.tensor(ref_weights(mask.tolist(), agg), dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    if not (variant == "gspo" and adv_per_token):
        torch.testing.assert_close(grad, reinforce_grad, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# numerical safety


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("big", [50.0, 1000.0])
@pytest.mark.parametrize("prox_side", [-1.0, 0.0, 1.0])
@pytest.mark.parametrize("agg", AGGS)
def test_extreme_log_ratios_are_finite(variant, big, prox_side, agg):
    B, T = 4, 6
    old = torch.full((B, T), -30.0, dtype=torch.float64)
    shift = big * torch.tensor([1.0, -1.0, 0.98, -0.98, 0.01, -0.01], dtype=torch.float64)
    logp = old + shift.roll(1)[None, :].repeat(B, 1)               # log-ratios up to +-big
    logp[1] = old[1] + big                                         # a whole sequence at +big (gspo)
    logp[2] = old[2] - big                                         # and one at -big
    prox = old + prox_side * big
    adv = torch.tensor([1.0, -2.0, 3.0, -1.5], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    # exp(1000) overflows every dtype; bfloat16 inputs are computed in float32 inside
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for hp in ({}, {"dual_clip": 3.0}):
            loss, grad, metrics = run(variant, logp.to(dtype), old.to(dtype), prox.to(dtype),
                                      adv.to(dtype), mask, agg=agg, **hp)
            assert torch.isfinite(loss) and torch.isfinite(grad).all()
            assert all(math.isfinite(v) for v in metrics.values())


def test_log_ratio_clamp_is_the_documented_one():
    # PPO, A < 0, log-ratio 50: the ratio is exp(20) after the clamp, and the clamp stops its gradient
    loss, grad, m = one_token("ppo", 50.0, -1.0)
    assert loss == pytest.approx(math.exp(20.0)) and grad == 0.0
    assert m["ratio_max"] == pytest.approx(math.exp(20.0))
    assert m["approx_kl"] == pytest.approx(math.exp(20.0) - 21.0)
    # inside the clamp the gradient is the exact one, -A r
    loss, grad, _ = one_token("ppo", 19.0, -1.0)
    assert (loss, grad) == (pytest.approx(math.exp(19.0)), pytest.approx(math.exp(19.0)))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("adv_per_token", [False, True])
@pytest.mark.parametrize("garbage", ["huge", "nonfinite"])
def test_masked_positions_contribute_exactly_nothing(variant, adv_per_token, garbage):
    logp, old, prox, adv, mask = make_batch(seed=3, adv_per_token=adv_per_token)
    clean = run(variant, logp, old, prox, adv, mask, agg="seq-mean-token-mean")
    off = mask == 0
    big = (1e30, -1e30) if garbage == "huge" else (float("nan"), float("inf"))
    logp, old, prox, adv = logp.clone(), old.clone(), prox.clone(), adv.clone()
    logp[off], old[off], prox[off] = big[0], big[1], -big[1]
    if adv_per_token:
        adv[off] = big[0]
    dirty = run(variant, logp, old, prox, adv, mask, agg="seq-mean-token-mean")
    assert torch.equal(dirty[0], clean[0])
    assert torch.equal(dirty[1], clean[1])
    assert torch.all(dirty[1][off] == 0)
    assert dirty[2] == clean[2]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("agg", AGGS)
def test_empty_mask_gives_zero_loss(variant, agg):
    logp, old, prox, adv, mask = make_batch(seed=4, adv_per_token=True)
    loss, grad, metrics = run(variant, logp, old, prox, adv, torch.zeros_like(mask), agg=agg)
    assert loss.item() == 0.0
    assert torch.all(grad == 0)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------------------------------------
# single behaviours, by hand


def one_token(variant, log_ratio, a, **hp):
    """Loss and d loss / d logp of a single token with logp = -1, old_logp = -1 - log_ratio."""
    logp = torch.tensor([[-1.0]], dtype=torch.float64)
    old = logp - log_ratio
    adv = torch.tensor([a], dtype=torch.float64)
    loss, grad, metrics = run(variant, logp, old, logp, adv, torch.ones(1, 1), **hp)
    return loss.item(), grad.item(), metrics


def test_ppo_dual_clip():
    ln5, ln2_5 = math.log(5.0), math.log(2.5)
    # A < 0, r = 5: PPO's loss is -r A = 5 with gradient -A r = 5; dual clip c = 3 caps it at 3, grad 0
    loss, grad, m = one_token("ppo", ln5, -1.0)
    assert (loss, grad, m["clip_frac"]) == (pytest.approx(5.0), pytest.approx(5.0), 0.0)
    loss, grad, m = one_token("ppo", ln5, -1.0, dual_clip=3.0)
    assert (loss, grad, m["clip_frac"]) == (pytest.approx(3.0), 0.0, 1.0)
    # A < 0, r = 2.5 < c: the dual clip is not active
    loss, grad, m = one_token("ppo", ln2_5, -1.0, dual_clip=3.0)
    assert (loss, grad, m["clip_frac"]) == (pytest.approx(2.5), pytest.approx(2.5), 0.0)
    # A > 0, r = 5: the ordinary clip at 1 + clip_high, the dual clip never applies
    loss, grad, m = one_token("ppo", ln5, 1.0, dual_clip=3.0)
    assert (loss, grad, m["clip_frac"]) == (pytest.approx(-1.2), 0.0, 1.0)
    # decoupled_ppo: the dual clip bounds the bracket, before the weight w = pi_prox / mu = 2
    logp = torch.tensor([[-1.0]], dtype=torch.float64)
    prox = logp - ln5                                              # r' = 5
    old = prox - math.log(2.0)                                     # w = 2
    loss, grad, m = run("decoupled_ppo", logp, old, prox, torch.tensor([-1.0], dtype=torch.float64),
                        torch.ones(1, 1), dual_clip=3.0)
    assert (loss.item(), grad.item()) == (pytest.approx(6.0), 0.0)
    assert m["is_weight_mean"] == pytest.approx(2.0) and m["ratio_max"] == pytest.approx(10.0)


def test_topr_split_by_sign():
    r3, r_half = math.log(3.0), math.log(0.5)
    # A > 0: no IS weight at all, even at r = 3, scaled by topr_pos_weight
    loss, grad, m = one_token("topr", r3, 2.0, topr_pos_weight=0.5, topr_neg_weight=4.0)
    assert (loss, grad) == (pytest.approx(-0.5 * 2.0 * -1.0), pytest.approx(-1.0))
    assert (m["is_weight_mean"], m["clip_frac"]) == (1.0, 0.0)
    # A < 0, r = 3: weight clip(3, 0, 1) = 1, scaled by topr_neg_weight
    loss, grad, m = one_token("topr", r3, -2.0, topr_pos_weight=0.5, topr_neg_weight=4.0)
    assert grad == pytest.approx(8.0) and (m["is_weight_mean"], m["clip_frac"]) == (1.0, 1.0)
    # A < 0, r = 0.5: weight 0.5, not truncated
    loss, grad, m = one_token("topr", r_half, -2.0, topr_pos_weight=0.5, topr_neg_weight=4.0)
    assert grad == pytest.approx(4.0) and m["is_weight_mean"] == pytest.approx(0.5)
    assert m["clip_frac"] == 0.0
    # A = 0 belongs to the negative side (weight clip(r, 0, 1)); it contributes no gradient
    loss, grad, m = one_token("topr", r3, 0.0)
    assert (grad, m["is_weight_mean"], m["clip_frac"]) == (0.0, 1.0, 1.0)
    loss, grad, m = one_token("topr", r_half, 0.0)
    assert (grad, m["is_weight_mean"], m["clip_frac"]) == (0.0, pytest.approx(0.5), 0.0)
    # per-token advantages: the rule is applied per token
    logp = torch.full((1, 2), -1.0, dtype=torch.float64)
    old = logp - r3
    adv = torch.tensor([[2.0, -2.0]], dtype=torch.float64)
    _, grad, m = run("topr", logp, old, logp, adv, torch.ones(1, 2), topr_neg_weight=4.0)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 4.0]], dtype=torch.float64))
    assert m["clip_frac"] == 0.5


def test_tis_truncation():
    logp = torch.full((1, 2), -1.0, dtype=torch.float64)
    old = logp - torch.tensor([[math.log(5.0), math.log(0.5)]], dtype=torch.float64)
    _, grad, m = run("tis", logp, old, logp, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2))
    # token-mean over 2 tokens: weights min(5, 2) = 2 (truncated) and 0.5 (never raised)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -0.25]], dtype=torch.float64))
    assert m["clip_frac"] == 0.5 and m["is_weight_mean"] == pytest.approx(1.25)
    assert m["ratio_max"] == pytest.approx(5.0) and m["ratio_mean"] == pytest.approx(2.75)


def test_cispo_default_has_no_lower_bound():
    _, grad, m = one_token("cispo", math.log(0.01), 1.0)
    assert grad == pytest.approx(-0.01) and m["clip_frac"] == 0.0
    _, grad, m = one_token("cispo", math.log(3.0), 1.0)
    assert grad == pytest.approx(-1.28) and m["clip_frac"] == 1.0


def test_gspo_uses_the_sequence_ratio():
    # token log-ratios +0.6 and -0.6 average to 0: s = 1, nothing clipped although each token's
    # own ratio is far outside [0.8, 1.2] (token-level PPO clips the r = 1.8 one, as A > 0);
    # gradient -A s / n per token under seq-mean-token-mean
    logp = torch.full((1, 2), -1.0, dtype=torch.float64)
    old = logp - torch.tensor([[0.6, -0.6]], dtype=torch.float64)
    _, grad, m = run("gspo", logp, old, logp, torch.tensor([1.0], dtype=torch.float64),
                     torch.ones(1, 2), agg="seq-mean-token-mean")
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -0.5]], dtype=torch.float64))
    assert m["clip_frac"] == 0.0
    _, _, m_ppo = run("ppo", logp, old, logp, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2))
    assert m_ppo["clip_frac"] == 0.5


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("adv_per_token", [False, True])
def test_metrics_are_floats_and_clip_frac_in_unit_interval(variant, adv_per_token):
    logp, old, prox, adv, mask = make_batch(seed=5, adv_per_token=adv_per_token)
    _, _, metrics = run(variant, logp, old, prox, adv, mask)
    assert set(metrics) == {"clip_frac", "ratio_mean", "ratio_max", "is_weight_mean", "approx_kl",
                            "behav_capped_frac"}
    assert all(type(v) is float and math.isfinite(v) for v in metrics.values())
    assert 0.0 <= metrics["clip_frac"] <= 1.0
    assert metrics["approx_kl"] >= 0.0
    if variant in ("reinforce", "ppo", "gspo"):
        assert metrics["is_weight_mean"] == 1.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_metrics_ignore_masked_tokens(variant):
    # unmasked ratios 0.5 and 0.25; the masked token (ratio 8) must not show in any metric
    logp = torch.full((1, 3), -1.0, dtype=torch.float64)
    old = logp - torch.tensor([[math.log(0.5), math.log(0.25), math.log(8.0)]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, _, m = run(variant, logp, old, old, torch.tensor([1.0], dtype=torch.float64), mask)
    assert m["ratio_max"] == pytest.approx(0.5) and m["ratio_mean"] == pytest.approx(0.375)
    kl = (0.5 - 1 - math.log(0.5) + 0.25 - 1 - math.log(0.25)) / 2
    assert m["approx_kl"] == pytest.approx(kl)


def test_advantages_and_old_logp_get_no_gradient():
    logp, old, prox, adv, mask = make_batch(seed=6, adv_per_token=False)
    old, adv = old.clone().requires_grad_(True), adv.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(logp.clone().requires_grad_(True), old, adv, mask, "ppo")
    loss.backward()
    assert old.grad is None and adv.grad is None


# ---------------------------------------------------------------------------------------------
# group advantages


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0],
                           dtype=torch.float64)
    eps = 1e-6
    # group 1: mean 0.5, population std 0.5; group 2: constant; group 3: mean 0.75,
    # population std sqrt((3 * 0.75**2 + 2.25**2) / 4)
    s3 = math.sqrt((3 * 0.75 ** 2 + 2.25 ** 2) / 4)
    expected = ([0.5 / (0.5 + eps), -0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.5 / (0.5 + eps)]
                + [0.0] * 4
                + [-0.75 / (s3 + eps)] * 3 + [2.25 / (s3 + eps)])
    out = group_advantages(rewards, 4, eps=eps)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    out = group_advantages(rewards, 4, scale=False)
    unscaled = [0.5, -0.5, -0.5, 0.5] + [0.0] * 4 + [-0.75, -0.75, -0.75, 2.25]
    torch.testing.assert_close(out, torch.tensor(unscaled, dtype=torch.float64))
    # groups are consecutive runs: group size 2 splits differently
    out = group_advantages(rewards[:4], 2, scale=False)
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64))
    # group size 1: every advantage is 0, finite
    assert torch.equal(group_advantages(rewards, 1), torch.zeros_like(rewards))
    # integer rewards are accepted
    assert group_advantages(torch.tensor([1, 0]), 2).dtype.is_floating_point


def test_adv_estimators_are_a_registry_behind_a_flag():
    """--adv-estimator: grpo divides by the group's std, drgrpo (Dr. GRPO) keeps the raw deviation from the
    group mean; an unknown name is refused naming the flag and the known ones, by the config and by the
    call."""
    from losses import ADV_ESTIMATORS, LossConfig, estimate_advantages
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    # group 1: mean 0.25, population std sqrt(3) / 4; group 2: mean 1.0, std sqrt(1.5)
    dev = [0.75, -0.25, -0.25, -0.25, -1.0, -1.0, 2.0, 0.0]
    stds = [math.sqrt(3) / 4] * 4 + [math.sqrt(1.5)] * 4
    torch.testing.assert_close(estimate_advantages(rewards, 4, "drgrpo"),
                               torch.tensor(dev, dtype=torch.float64))
    torch.testing.assert_close(estimate_advantages(rewards, 4, "grpo"),
                               torch.tensor([d / (s + 1e-6) for d, s in zip(dev, stds)], dtype=torch.float64))
    assert estimate_advantages(rewards, 4).equal(estimate_advantages(rewards, 4, "grpo"))   # the default
    assert set(ADV_ESTIMATORS) >= {"grpo", "drgrpo"} and LossConfig().adv_estimator == "grpo"
    assert LossConfig(adv_estimator="drgrpo").adv_estimator == "drgrpo"
    want = "--adv-estimator 'rloo': known: " + ", ".join(ADV_ESTIMATORS)
    for make in (lambda: LossConfig(adv_estimator="rloo"), lambda: estimate_advantages(rewards, 4, "rloo")):
        with pytest.raises(ValueError) as e:
            make()
        assert str(e.value) == want
    assert "adv_estimator" not in LossConfig().loss_kwargs()          # not a loss keyword: losses stay pure


def test_adv_estimator_reaches_both_call_sites():
    """The flag's estimator is what rl_step (whole batches: WholeBatch's estimator argument)
    and the streaming trainer (TrainStream, per group) compute the advantages with."""
    import asyncio

    from buffer import LocalQueues, Sample, SampleBuffer
    from controller import AsyncController, ControllerConfig, WholeBatch, rl_step
    from ext.stream_trainer import TrainStream
    from task import Problem
    batch = [Sample(f"t{i}", f"g{i // 2}", [1], [2], [0.0], [1], [0], r)
             for i, r in enumerate([1.0, 0.0, 3.0, 3.0])]
    drgrpo = [0.5, -0.5, 0.0, 0.0]

    async def whole_batch(estimator):
        ctrl = AsyncController(ControllerConfig(batch_groups=2, group_size=2, redundant=0),
                               SampleBuffer(LocalQueues(1), "test"), iter([Problem("1+1=", "2")]), 1)

        async def collect(on_group=None, stream=False):
            for g in (batch[:2], batch[2:]):
                on_group(g)
            return batch, {}

        async def sync_weights(*args, **kwargs):
            return {}
        ctrl.collect, ctrl.sync_weights, seen = collect, sync_weights, []

        async def train(samples, advantages, version):
            seen.append(advantages)
            return {}, None
        await rl_step(ctrl, WholeBatch(train, 2, **({"estimator": estimator} if estimator else {})), None)
        return seen[0]
    assert asyncio.run(whole_batch("drgrpo")) == pytest.approx(drgrpo)
    assert asyncio.run(whole_batch(None)) == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)   # grpo

    class Backend:
        def __init__(self):
            self.seen = []

        async def begin(self, version):
            pass

        async def add(self, samples, advantages):
            self.seen += advantages

        async def step(self, version):
            return {}, None

    async def streamed():
        stream = TrainStream(2, backend, timeout_s=30, estimator="drgrpo")
        stream.begin(0)
        stream.add(batch[:2])
        stream.add(batch[2:])
        await stream.finish()
    backend = Backend()
    asyncio.run(streamed())
    assert backend.seen == pytest.approx(drgrpo)


def test_adv_estimator_is_a_train_py_flag(capsys):
    from config import parse_cli
    from train import Config
    assert parse_cli(Config, ["--adv-estimator", "drgrpo"]).train.adv_estimator == "drgrpo"
    with pytest.raises(SystemExit):
        parse_cli(Config, ["--adv-estimator", "rloo"])
    assert "--adv-estimator 'rloo': known: grpo, drgrpo" in capsys.readouterr().err


def test_gspo_aggregates_per_sequence_unless_told_otherwise():
    from losses import LossConfig
    gspo = LossConfig(loss="gspo")
    assert gspo.agg == "seq-mean-token-mean" == gspo.loss_kwargs()["agg"]
    assert LossConfig(loss="gspo", loss_agg="token-mean").loss_kwargs()["agg"] == "token-mean"
    assert LossConfig().agg == "token-mean" == LossConfig(loss="ppo", loss_agg="auto").loss_kwargs()["agg"]
    help = next(f for f in dataclasses.fields(LossConfig) if f.name == "loss_agg").metadata["help"]
    assert "seq-mean-token-mean for gspo" in help and "token-mean for the others" in help
    with pytest.raises(ValueError, match="--loss-agg"):
        LossConfig(loss_agg="seq-sum")


@pytest.mark.parametrize("n, g", [(10, 4), (3, 2)])
def test_group_advantages_bad_group_size_names_both_numbers(n, g):
    with pytest.raises(ValueError, match=rf"{n}.*{g}"):
        group_advantages(torch.zeros(n), g)


@pytest.mark.parametrize("g", [0, -2, 2.0, True])
def test_group_advantages_rejects_non_positive_int_group(g):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), g)


def test_group_advantages_rejects_2d():
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)


# ---------------------------------------------------------------------------------------------
# bad inputs


def batch_args():
    logp, old, prox, adv, mask = make_batch(seed=8, adv_per_token=False)
    return logp, old, adv, mask


def test_unknown_variant_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        compute_policy_loss(*batch_args(), "grpo")
    assert "grpo" in str(e.value) and all(v in str(e.value) for v in VARIANTS)


def test_decoupled_ppo_needs_prox_logp():
    with pytest.raises(ValueError, match="decoupled_ppo.*prox_logp"):
        compute_policy_loss(*batch_args(), "decoupled_ppo")


def test_unknown_hyperparameter_is_named():
    with pytest.raises(TypeError, match="clip_hihg"):
        compute_policy_loss(*batch_args(), "ppo", clip_hihg=0.3)


@pytest.mark.parametrize("name, value", [
    ("dual_clip", 1.0), ("dual_clip", 0.5), ("clip_low", -0.1), ("clip_low", 1.5),
    ("clip_high", -0.2), ("tis_cap", 0.0), ("cispo_low", -1.0), ("cispo_high", float("nan")),
    ("topr_pos_weight", -1.0), ("topr_neg_weight", "1"), ("agg", "sum"), ("behav_weight_cap", -1.0),
    ("gspo_clip_low", 1.5),
])
def test_bad_hyperparameter_values_are_named(name, value):
    """Refused naming the flag: a shared one whichever loss runs, a loss's own (checked by its hparams
    dataclass) when that loss runs."""
    owner = {"tis_cap": "tis", "cispo_low": "cispo", "cispo_high": "cispo", "topr_pos_weight": "topr",
             "topr_neg_weight": "topr", "behav_weight_cap": "decoupled_ppo", "gspo_clip_low": "gspo"}
    logp, old, adv, mask = batch_args()
    with pytest.raises(ValueError, match=flag("loss_agg" if name == "agg" else name)):
        compute_policy_loss(logp, old, adv, mask, owner.get(name, "ppo"), prox_logp=old, **{name: value})


def test_shape_mismatches():
    logp, old, adv, mask = batch_args()
    B, T = logp.shape
    with pytest.raises(ValueError, match="old_logp"):
        compute_policy_loss(logp, old[:, 1:], adv, mask, "ppo")
    with pytest.raises(ValueError, match="mask"):
        compute_policy_loss(logp, old, adv, mask[1:], "ppo")
    with pytest.raises(ValueError, match="prox_logp"):
        compute_policy_loss(logp, old, adv, mask, "decoupled_ppo", prox_logp=old.T)
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(logp, old, torch.zeros(B + 1), mask, "ppo")
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(logp, old, torch.zeros(B, T + 1), mask, "ppo")
    with pytest.raises(ValueError, match="logp"):
        compute_policy_loss(logp[0], old[0], adv, mask[0], "ppo")


def test_behaviour_weight_cap_drops_tokens_far_off_policy():
    """decoupled_ppo with behav_weight_cap: a token whose w = pi_prox / mu exceeds the cap gets no
    loss and no gradient; the others are as without the cap."""
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    prox = torch.tensor([[-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -3.0, -1.1]])            # w = 1, e^2 = 7.39, e^0.1 = 1.105
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3)
    loss, m = compute_policy_loss(logp, old, adv, mask, "decoupled_ppo", prox_logp=prox, behav_weight_cap=5.0)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] < 0 and logp.grad[0, 2] < 0
    assert m["behav_capped_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx((1 + 0 + math.exp(0.1)) / 3)


# ---------------------------------------------------------------------------------------------
# rollout correction (--is-correction): hand-computed cases

RHO = [3.0, 0.25, 1.5, 6.0]          # pi_prox / mu of four tokens of one sequence


def correction_case():
    """One sequence of four tokens and a second whose last two tokens are masked; prox - old = log RHO."""
    prox = torch.full((2, 4), -1.0, dtype=torch.float64)
    old = prox - torch.tensor([[math.log(x) for x in RHO]] * 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    return prox, old, mask


@pytest.mark.parametrize("mode, level, want_w, want_corrected", [
    ("tis", "token", [2.0, 0.25, 1.5, 2.0], [1, 0, 0, 1]),            # truncated at 2
    ("mis", "token", [0.0, 0.0, 1.5, 0.0], [1, 1, 0, 1]),             # kept inside [1/2, 2], weight rho
    ("icepop", "token", [1.0, 0.0, 1.0, 0.0], [0, 1, 0, 1]),          # kept inside [0.5, 5], weight 1
    ("tis", "sequence", [2.0] * 4, [1] * 4),                          # 3 * 0.25 * 1.5 * 6 = 6.75 -> 2
    ("mis", "sequence", [0.0] * 4, [1] * 4),                          # 6.75 > 2: the sequence dropped
    ("icepop", "sequence", [0.0] * 4, [1] * 4),                       # 6.75 > 5
])
def test_rollout_correction_by_hand(mode, level, want_w, want_corrected):
    from losses import rollout_correction
    prox, old, mask = correction_case()
    m = mask != 0
    w, corrected = rollout_correction(torch.where(m, prox, 0.0), torch.where(m, old, 0.0), m, mode, level)
    torch.testing.assert_close(w[0], torch.tensor(want_w, dtype=torch.float64))
    assert corrected[0].tolist() == [bool(x) for x in want_corrected]
    assert w[1, 2:].tolist() == [0.0, 0.0] and not corrected[1, 2:].any()   # masked tokens: nothing
    if level == "sequence":      # the second sequence's ratio is 3 * 0.25 = 0.75: kept by all three
        assert w[1, :2].tolist() == pytest.approx([{"tis": 0.75, "mis": 0.75, "icepop": 1.0}[mode]] * 2)


def test_ppo_with_tis_correction_is_ppo_against_pi_prox_times_the_truncated_weight():
    prox, old, mask = correction_case()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    # pi = pi_prox: the PPO ratio against pi_prox is 1 (unclipped), however far mu is
    loss, grad, m = run("ppo", prox, old, prox, adv, mask, is_correction="tis", is_cap=2.0)
    w = torch.tensor([[2.0, 0.25, 1.5, 2.0], [2.0, 0.25, 0.0, 0.0]], dtype=torch.float64)
    A = torch.tensor([[1.0] * 4, [-1.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, -w * A / 6)                     # token-mean over 6 tokens, dr/dlogp = 1
    assert loss.item() == pytest.approx((-(2 + 0.25 + 1.5 + 2) + (2 + 0.25)) / 6)
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0    # the ratio is pi / pi_prox
    rhos = RHO + RHO[:2]
    assert m["mismatch_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in rhos) / 6)
    assert m["is_corrected_frac"] == pytest.approx(3 / 6) and m["is_weight_max"] == 2.0
    # approx_kl stays KL(mu || pi) under a correction (here pi = pi_prox, so it is the mismatch), not 0
    assert m["approx_kl"] == pytest.approx(m["mismatch_kl"]) and m["approx_kl"] > 0.1
    # without the correction, plain ppo against mu clips 3 of these tokens: the two differ
    _, plain, _ = run("ppo", prox, old, prox, adv, mask)
    assert not torch.allclose(plain, grad)


@pytest.mark.parametrize("mode", ["tis", "mis", "icepop"])
def test_ppo_and_decoupled_ppo_are_one_objective_under_a_correction(mode):
    """Both become PPO clipped against pi_prox times the correction's weight (the study runs ppo+X only)."""
    prox, old, mask = correction_case()
    logp = prox + torch.tensor([[0.3, -0.4, 0.1, 0.5], [-0.2, 0.35, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss_a, grad_a, _ = run("ppo", logp, old, prox, adv, mask, is_correction=mode)
    loss_b, grad_b, _ = run("decoupled_ppo", logp, old, prox, adv, mask, is_correction=mode)
    torch.testing.assert_close(grad_a, grad_b)
    assert loss_a.item() == pytest.approx(loss_b.item()) and grad_a.abs().sum() > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_ref_prox_puts_pi_prox_where_each_formula_has_mu(variant):
    """--recompute-old-logprobs: the ratio's old policy is pi_prox; decoupled_ppo keeps mu in its weight;
    reinforce has no old policy; a correction already implies it."""
    prox, old, mask = correction_case()                # mu = old, 0.5x to 4x away from pi_prox per token
    logp = prox + torch.tensor([[0.3, -0.4, 0.1, 0.5], [-0.2, 0.35, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    _, ref, _ = run(variant, logp, old, prox, adv, mask, ref_prox=True)
    _, against_mu, _ = run(variant, logp, old, prox, adv, mask)
    _, against_prox, _ = run(variant, logp, prox, prox, adv, mask)      # mu replaced by pi_prox outright
    if variant == "reinforce":
        torch.testing.assert_close(ref, against_mu)
    elif variant == "decoupled_ppo":                   # w = pi_prox / mu stays (it would be 1 against prox)
        torch.testing.assert_close(ref, against_mu)
        assert not torch.allclose(ref, against_prox)
    else:
        torch.testing.assert_close(ref, against_prox)
        assert not torch.allclose(ref, against_mu)
    _, corrected, _ = run(variant, logp, old, prox, adv, mask, is_correction="tis")
    _, both, _ = run(variant, logp, old, prox, adv, mask, is_correction="tis", ref_prox=True)
    torch.testing.assert_close(both, corrected)
    with pytest.raises(ValueError, match="ref_prox=True needs prox_logp"):
        compute_policy_loss(logp, old, adv, mask, variant, ref_prox=True)


def test_decoupled_ppo_with_icepop_takes_the_mask_as_its_behaviour_weight():
    prox, old, mask = correction_case()
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    _, grad, m = run("decoupled_ppo", prox, old, prox, adv, mask, is_correction="icepop")
    keep = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, -keep / 6)                      # w: 1 kept, 0 dropped (not pi_prox / mu)
    assert m["is_weight_mean"] == pytest.approx(3 / 6)


def test_correction_needs_prox_logp_and_checks_its_settings():
    with pytest.raises(ValueError, match="--is-correction tis needs prox_logp"):
        compute_policy_loss(*batch_args(), "ppo", is_correction="tis")
    logp, old, adv, mask = batch_args()
    for bad in (dict(is_correction="clip"), dict(is_level="batch"), dict(is_cap=1.0),
                dict(icepop_low=1.5), dict(icepop_high=0.9)):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            compute_policy_loss(logp, old, adv, mask, "ppo", prox_logp=old, **bad)


# ---------------------------------------------------------------------------------------------
# --kl-coef's penalty: k3 to a reference, clamped (verl's low_var_kl)


@pytest.mark.parametrize("agg", AGGS)
def test_kl_penalty_is_the_clamped_k3_estimate_by_hand(agg):
    """kl = exp(ref - logp) - (ref - logp) - 1 per token, clamped to [-10, 10], aggregated over the mask like
    the policy loss; d kl / d logp = 1 - exp(ref - logp) inside the clamp, 0 where it binds. Written out on
    floats: one token at the clamp (ref - logp = 12.5: k3 ~ 2.7e5), one with logp == ref (0), masked ones
    holding garbage that must not count."""
    from losses import kl_penalty
    logp = [[-1.0, -2.0, -0.5, float("nan")], [-3.0, -0.2, -13.0, -1.0]]
    ref = [[-1.5, -2.0, -3.0, 5.0], [-1.0, -0.7, -0.5, float("inf")]]
    mask = [[1, 1, 1, 0], [1, 1, 1, 0]]
    per_tok, grad = {}, {}
    for b in range(2):
        for t in range(4):
            if mask[b][t]:
                d = ref[b][t] - logp[b][t]
                k3 = math.exp(d) - d - 1
                per_tok[b, t] = min(max(k3, -10.0), 10.0)
                grad[b, t] = (1.0 - math.exp(d)) if -10 < k3 < 10 else 0.0
    if agg == "token-mean":
        want = sum(per_tok.values()) / len(per_tok)
        scale = {k: 1 / len(per_tok) for k in per_tok}
    else:
        rows = {b: [k for k in per_tok if k[0] == b] for b in range(2)}
        want = sum(sum(per_tok[k] for k in ks) / len(ks) for ks in rows.values()) / 2
        scale = {k: 1 / (len(rows[k[0]]) * 2) for k in per_tok}
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    loss, m = kl_penalty(lp, torch.tensor(ref, dtype=torch.float64), torch.tensor(mask), agg=agg)
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert m["kl"] == pytest.approx(sum(per_tok.values()) / len(per_tok), rel=1e-12)
    for (b, t), g in grad.items():
        assert lp.grad[b, t].item() == pytest.approx(g * scale[b, t], rel=1e-9, abs=1e-15)
    assert lp.grad[0, 3].item() == 0 and lp.grad[1, 3].item() == 0       # masked: nothing, not even nan
    assert per_tok[1, 2] == 10.0 and per_tok[0, 1] == 0.0                # the clamp bound, and logp == ref


def test_kl_coef_is_validated_and_not_a_policy_loss_keyword():
    from losses import LossConfig
    with pytest.raises(ValueError, match="--kl-coef"):
        LossConfig(kl_coef=-0.1)
    assert "kl_coef" not in LossConfig(kl_coef=0.05).loss_kwargs()
