"""Lab 5's grader: lag_ppo registered, on toy tensors with known lags against a hand computation, and through
a real trainer.Trainer (the embedded tiny model, CPU) whose samples' versions make the lags."""

import math

import pytest
import torch

import losses
from buffer import Sample
from labs.grading import load
from losses import LossConfig, compute_policy_loss
from trainer import TrainConfig, Trainer, collate, token_logprobs

impl = load("lab5_lag_loss")
torch.set_num_threads(1)       # (the tiny model's steps are small: more threads only spin against each other)
CLIP = dict(clip_low=0.2, clip_high=0.28)


def registered():
    assert losses.LOSSES.get("lag_ppo") is impl.lag_ppo, 'register it: losses.LOSSES["lag_ppo"] = lag_ppo'


def test_registered_with_its_own_flag():
    registered()
    kw = LossConfig(loss="lag_ppo").loss_kwargs()                               # --loss lag_ppo accepts it
    assert kw.get("lag_decay") == 0.5, (
        f"--loss lag_ppo's keywords {sorted(kw)} lack lag_decay = 0.5: mark lag_ppo @loss(hparams=LagParams)")


# toy batch: 2 sequences x 3 tokens, token [1, 1] masked; log r per token, advantages per sequence, lags
LOGP = [[-1.0, -0.5, -2.0], [-1.5, -0.2, -0.7]]
LOG_R = [[0.1, -0.4, 0.5], [0.0, 0.3, -0.1]]           # r = e^0.5 = 1.65 and e^-0.4 = 0.67: clipped
ADV, MASK = [1.0, -1.0], [[1, 1, 1], [1, 0, 1]]
LAG = [[0.0, 1.0, 2.0], [3.0, 7.0, 1.0]]


def toy(name: str, decay: float, lag=LAG):
    logp = torch.tensor(LOGP, requires_grad=True)
    old = logp.detach() - torch.tensor(LOG_R)
    loss, metrics = compute_policy_loss(logp, old, torch.tensor(ADV), torch.tensor(MASK), name,
                                        fields={"lag": torch.tensor(lag)}, lag_decay=decay, **CLIP)
    loss.backward()
    return loss.item(), metrics, logp.grad


@pytest.mark.parametrize("decay", [0.25, 0.5, 1.0])
def test_toy_tensors_by_hand(decay):
    """The batch's loss: the token mean of decay ** lag * PPO's loss, over the unmasked tokens."""
    registered()
    want = 0.0
    for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2)]:
        r, a = math.exp(LOG_R[b][t]), ADV[b]
        want += decay ** LAG[b][t] * max(-r * a, -min(max(r, 0.8), 1.28) * a)
    got, _, _ = toy("lag_ppo", decay)
    assert got == pytest.approx(want / 5, rel=1e-6), f"lag_decay {decay}: loss {got}, by hand {want / 5}"


def test_each_tokens_gradient_is_ppos_times_decay_to_its_lag():
    """Weighing the loss weighs the gradient: token by token, d loss / d logp is PPO's times decay ** lag
    (0 where masked or clipped); and PPO's extras pass through (the same clip_frac)."""
    registered()
    _, metrics, grad = toy("lag_ppo", 0.5)
    _, ppo_metrics, ppo_grad = toy("ppo", 0.5)
    torch.testing.assert_close(grad, ppo_grad * 0.5 ** torch.tensor(LAG),
                               msg="the gradient is not PPO's times decay ** lag (a detach?)")
    assert grad[1, 1] == 0 and grad.abs().sum() > 0, "a masked token has no gradient, the others some"
    assert metrics["clip_frac"] == ppo_metrics["clip_frac"] > 0, "pass PPO's extras ({'clipped': ...}) along"


def test_on_policy_or_no_decay_is_ppo():
    registered()
    on_policy, ppo = toy("lag_ppo", 0.5, lag=[[0.0] * 3] * 2)[0], toy("ppo", 0.5)[0]
    assert on_policy == pytest.approx(ppo, rel=1e-6), f"every lag 0: loss {on_policy}, PPO's {ppo}"
    no_decay, ppo = toy("lag_ppo", 1.0)[0], toy("ppo", 1.0)[0]
    assert no_decay == pytest.approx(ppo, rel=1e-6), f"lag_decay 1: loss {no_decay}, PPO's {ppo}"


# --- through the trainer

VERSION = 8                                            # the trainer's version: lag = 8 - a token's version
VERSIONS = [[8] * 5, [7] * 5, [6] * 5, [5, 5, 7, 7, 8]]   # lags 0; 1; 2; 3, 3, 1, 1, 0
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]
DECAY = 0.5


def trainer(loss: str) -> Trainer:
    import tiny_model
    cfg = TrainConfig(loss=loss, lr=1e-3)
    if loss == "lag_ppo":
        cfg.hparams["lag_ppo"] = impl.LagParams(lag_decay=DECAY)                 # --lag-decay 0.5
    return Trainer(str(tiny_model.ensure_tiny_model()), cfg)


def on_policy_samples(tr: Trainer, versions: list[list[int]]) -> list[Sample]:
    """Samples of 4 prompt and 5 response tokens whose behaviour logprobs are the trainer's own (r = 1, so
    PPO's per-token loss is -A), with these per-token versions."""
    g = torch.Generator().manual_seed(0)
    out = [Sample(f"t{i}", f"g{i}", torch.randint(2, 20, (4,), generator=g).tolist(),
                  torch.randint(2, 20, (5,), generator=g).tolist(), [0.0] * 5, [1] * 5, v, 0.0)
           for i, v in enumerate(versions)]
    t = collate(out, "cpu")
    with torch.no_grad():
        lp = token_logprobs(tr.model, t["input_ids"], t["attn"])
    for i, s in enumerate(out):
        s.logprobs = lp[i, 4:9].tolist()
    return out


def test_through_the_trainer_the_loss_weighs_each_token_by_its_lag():
    """train_step with the trainer at version 8: each token's lag is 8 minus its version, and the step's loss
    is the token mean of -A * 0.5 ** lag (on-policy logprobs: PPO's per-token loss is -A)."""
    registered()
    tr = trainer("lag_ppo")
    metrics = tr.train_step(on_policy_samples(tr, VERSIONS), ADVANTAGES, version=VERSION)
    want = sum(-a * DECAY ** (VERSION - v) for a, vs in zip(ADVANTAGES, VERSIONS) for v in vs) / 20
    assert metrics["loss"] == pytest.approx(want, abs=1e-5), f"the step's loss {metrics['loss']}, want {want}"


def test_through_the_trainer_the_gradient_is_ppos_with_weighed_advantages():
    """Samples whose tokens share one lag: lag_ppo's gradient is PPO's, each advantage times 0.5 ** lag."""
    registered()
    versions, grads = VERSIONS[:3], []
    for loss, adv in (("lag_ppo", ADVANTAGES[:3]),
                      ("ppo", [a * DECAY ** (VERSION - v[0]) for a, v in zip(ADVANTAGES, versions)])):
        tr = trainer(loss)
        tr.train_step(on_policy_samples(tr, versions), adv, version=VERSION)
        grads.append([p.grad.clone() for p in tr.model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(*grads)), (
        "the trainer's gradient under lag_ppo is not PPO's with advantages weighed by decay ** lag")
