"""Lab 2's reference: the project's own clipped surrogate (losses._ppo_clip, what losses.ppo calls)."""

import torch

from losses import _ppo_clip


def ppo_token_loss(r: torch.Tensor, A: torch.Tensor, clip_low: float, clip_high: float,
                   dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _ppo_clip(r, A, clip_low, clip_high, dual_clip)
