"""Lab 5's reference: lag_ppo over the project's own losses.ppo."""

from dataclasses import dataclass

from config import check, opt
from losses import LOSSES, Terms, loss, ppo


@dataclass
class LagParams:
    lag_decay: float = opt(0.5, "lag_ppo: each token's loss times this ** its lag (versions behind)")

    def __post_init__(self):
        check(self, above=dict(lag_decay=0), at_most=dict(lag_decay=1))


@loss(hparams=LagParams)
def lag_ppo(t: Terms):
    loss_tok, extra = ppo(t)
    return t.hp["lag_decay"] ** t.lag * loss_tok, extra


LOSSES["lag_ppo"] = lag_ppo
