"""Lab 2: PPO's clipped surrogate, per token, with the dual clip.

Under asynchrony every trained token was sampled by a behaviour policy mu (the engine, maybe a few
versions behind) and is trained under the current policy pi. The ratio r = pi / mu of each token
(`losses.Terms.r`) weighs its advantage A: the surrogate -r * A. PPO clips r to [1 - clip_low,
1 + clip_high] and takes the larger (more pessimistic) of the clipped and the unclipped loss, so a token
whose ratio already moved far in the advantage's direction stops pushing: its gradient is zero. The dual
clip (Ye et al. 2020) bounds the loss of a token with A < 0 at -dual_clip * A, so one token whose ratio
exploded (a very stale sample, say) cannot dominate the batch.

Per token (elementwise, any shape; minimise it):

    loss = max(-r * A, -clip(r, 1 - clip_low, 1 + clip_high) * A)
    dual_clip c (0 or None: off): where A < 0, loss = min(loss, -c * A)

Return the loss and a bool tensor `clipped`: the tokens where a clip decided the loss (the clipped term
was strictly larger than the unclipped one, or the dual clip bound it); it feeds the `clip_frac` metric.

docs/tour.md's section 5 tells where the loss runs. Read for inspiration: `losses.ppo` (the loss as the
trainer calls it, through `losses.Terms`), and `losses.compute_policy_loss` (how r, A and the mask are made).
Use torch operations only, so that autograd gives each token's gradient: the grader checks values by hand,
that the gradient is zero where clipped, and that your function, registered as a loss, gives the same loss,
metrics and gradient as `--loss ppo`.

    .venv/bin/python -m pytest labs/lab2_ppo_clip_test.py
"""

import torch


def ppo_token_loss(r: torch.Tensor, A: torch.Tensor, clip_low: float, clip_high: float,
                   dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """r: ratios pi / mu (with grad), A: advantages, same shape. Returns (loss, clipped), both that shape."""
    raise NotImplementedError("lab 2: ppo_token_loss()")
