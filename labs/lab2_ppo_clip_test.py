"""Lab 2's grader: ppo_token_loss() on toy tensors against values computed by hand (clip_low 0.2, clip_high
0.28, DAPO's clip-higher: an asymmetric range, so swapped bounds show), its gradient by autograd, and the
function registered as a loss against the project's `--loss ppo`."""

import pytest
import torch

import losses
from labs.grading import load

impl = load("lab2_ppo_clip")
LOW, HIGH = 0.2, 0.28

# (r, A) -> (loss, clipped, d loss / d r), computed by hand: unclipped -r A, clipped -clip(r, 0.8, 1.28) A
NO_DUAL = [
    ((1.0, 1.0), (-1.0, False, -1.0)),      # on-policy: the plain surrogate
    ((1.5, 1.0), (-1.28, True, 0.0)),       # A > 0, r above 1 + clip_high: capped, no gradient
    ((1.25, 1.0), (-1.25, False, -1.0)),    # inside 1 + clip_high (not 1 + clip_low)
    ((0.5, 1.0), (-0.5, False, -1.0)),      # A > 0, r low: the unclipped loss is the larger, it counts
    ((0.5, -1.0), (0.8, True, 0.0)),        # A < 0, r below 1 - clip_low: capped, no gradient
    ((0.75, -1.0), (0.8, True, 0.0)),       # below 1 - clip_low (not 1 - clip_high)
    ((1.5, -1.0), (1.5, False, 1.0)),       # A < 0, r high: the unclipped loss is the larger, it counts
    ((5.0, -1.0), (5.0, False, 1.0)),       # ... however large (no dual clip)
    ((10.0, 2.0), (-2.56, True, 0.0)),
    ((1.1, 0.0), (0.0, False, 0.0)),        # no advantage, no loss
    ((0.9, 0.5), (-0.45, False, -0.5)),
    ((0.7, 2.0), (-1.4, False, -2.0)),
]
# dual clip 3: where A < 0 the loss is at most -3 A
DUAL = [
    ((5.0, -1.0), (3.0, True, 0.0)),        # bounded at -3 A = 3
    ((2.0, -1.0), (2.0, False, 1.0)),       # under the bound: as before
    ((4.0, -2.0), (6.0, True, 0.0)),        # -r A = 8 > -3 A = 6
    ((10.0, 2.0), (-2.56, True, 0.0)),      # A > 0: the dual clip does not apply
    ((0.5, -1.0), (0.8, True, 0.0)),        # the ordinary clip still does
    ((1.5, -1.0), (1.5, False, 1.0)),
]


def run(cases, dual_clip):
    r = torch.tensor([c[0][0] for c in cases], requires_grad=True)
    A = torch.tensor([c[0][1] for c in cases])
    out = impl.ppo_token_loss(r, A, LOW, HIGH, dual_clip)
    assert isinstance(out, tuple) and len(out) == 2, f"return (loss, clipped), got {type(out).__name__}"
    loss, clipped = out
    assert loss.shape == r.shape and clipped.shape == r.shape, (
        f"elementwise: loss and clipped have r's shape {tuple(r.shape)}, got {tuple(loss.shape)} and "
        f"{tuple(clipped.shape)}")
    loss.sum().backward()
    return loss.detach(), clipped, r.grad


WHAT = {0: "loss", 1: "clipped", 2: "d loss / d r"}


def explain(cases, i, what: int, got, dual_clip) -> str:
    """Case i, in words: its inputs, what the function gave and what it should (what: 0 loss, 1 clipped, 2
    the gradient)."""
    (r, A), want = cases[i][0], cases[i][1][what]
    side = ("A > 0" if A > 0 else "A < 0" if A < 0 else "A = 0") + (
        f", r below 1 - clip_low = {1 - LOW:g}" if r < 1 - LOW else f", r above 1 + clip_high = {1 + HIGH:g}"
        if r > 1 + HIGH else ", r inside the clip range")
    return (f"r={r}, A={A} ({side}), clip_low={LOW}, clip_high={HIGH}, dual_clip={dual_clip}: "
            f"{WHAT[what]} is {got}, want {want}")


@pytest.mark.parametrize("cases, dual_clip", [(NO_DUAL, None), (NO_DUAL, 0.0), (DUAL, 3.0)],
                         ids=["dual-none", "dual-0", "dual-3"])
def test_loss_by_hand(cases, dual_clip):
    loss, _, _ = run(cases, dual_clip)
    for i, (_, (want, _, _)) in enumerate(cases):
        got = loss[i].item()
        assert got == pytest.approx(want, abs=1e-6), explain(cases, i, 0, got, dual_clip)


@pytest.mark.parametrize("cases, dual_clip", [(NO_DUAL, None), (DUAL, 3.0)], ids=["dual-none", "dual-3"])
def test_clipped_tokens_by_hand(cases, dual_clip):
    _, clipped, _ = run(cases, dual_clip)
    assert clipped.dtype == torch.bool, f"clipped: a bool tensor, got {clipped.dtype}"
    for i, (_, (_, want, _)) in enumerate(cases):
        assert bool(clipped[i]) is want, explain(cases, i, 1, bool(clipped[i]), dual_clip) + (
            " (clipped: a clip decided the loss, i.e. the clipped term was the larger, or the dual clip "
            "bound it; r outside the range alone does not say that)")


@pytest.mark.parametrize("cases, dual_clip", [(NO_DUAL, None), (DUAL, 3.0)], ids=["dual-none", "dual-3"])
def test_gradient_is_zero_where_clipped(cases, dual_clip):
    """d loss / d r: -A where the unclipped surrogate decides the loss, exactly 0 where a clip does (the
    token no longer pushes the policy: the trust region)."""
    _, clipped, grad = run(cases, dual_clip)
    assert grad is not None, "no gradient reached r: use torch operations on r (no .item(), no detach)"
    for i, (_, (_, _, want)) in enumerate(cases):
        got = grad[i].item()
        assert got == pytest.approx(want, abs=1e-6), explain(cases, i, 2, got, dual_clip)
    assert torch.all(grad[clipped] == 0), "a token marked clipped still has a gradient"


def test_any_shape():
    r = torch.tensor([[0.5, 1.0, 1.5], [2.0, 0.9, 1.1]])
    A = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, clipped = impl.ppo_token_loss(r, A, LOW, HIGH, 3.0)
    assert loss.shape == (2, 3) and clipped.shape == (2, 3), (
        f"a [2, 3] batch of ratios gave a loss of shape {tuple(loss.shape)} and clipped "
        f"{tuple(clipped.shape)}: elementwise, the shape of r")
    torch.testing.assert_close(loss.detach(), torch.tensor([[-0.5, -1.0, -1.28], [2.0, 0.9, 1.1]]),
                               msg=lambda m: f"a [2, 3] batch (dual_clip 3): {m}")


@pytest.mark.parametrize("dual_clip", [0.0, 3.0])
def test_as_a_loss_it_is_the_projects_ppo(monkeypatch, dual_clip):
    """Registered as a loss of `losses.Terms` (as `losses.ppo` is), through `losses.compute_policy_loss` on a
    batch with masked tokens and stale ratios: the same loss, clip fraction and gradient as --loss ppo."""
    @losses.loss()
    def lab_ppo(t: losses.Terms):
        hp = t.hp
        loss_tok, clipped = impl.ppo_token_loss(t.r, t.A, hp["clip_low"], hp["clip_high"], hp["dual_clip"])
        return loss_tok, {"clipped": clipped}
    monkeypatch.setitem(losses.LOSSES, "lab_ppo", lab_ppo)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 10, generator=g) * 3
    drift = torch.randn(6, 10, generator=g) * 0.6               # log r: many tokens outside the clip range
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 0.0, 1.5])
    mask = (torch.rand(6, 10, generator=g) > 0.2).long()
    results = []
    for name in ("lab_ppo", "ppo"):
        logp = (old + drift).requires_grad_(True)
        loss, metrics = losses.compute_policy_loss(logp, old, adv, mask, name, clip_low=LOW, clip_high=HIGH,
                                                   dual_clip=dual_clip)
        loss.backward()
        results.append((loss.item(), metrics, logp.grad))
    (mine, mine_m, mine_g), (ppo, ppo_m, ppo_g) = results
    assert ppo_m["clip_frac"] > 0.2, "the grader's batch no longer exercises the clip"
    assert mine == pytest.approx(ppo, rel=1e-6), "the batch's loss differs from --loss ppo's"
    assert mine_m["clip_frac"] == pytest.approx(ppo_m["clip_frac"]), "clip_frac differs: check `clipped`"
    torch.testing.assert_close(mine_g, ppo_g, msg="the gradient differs from --loss ppo's")
