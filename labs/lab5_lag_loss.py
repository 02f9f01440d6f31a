"""Lab 5: a lag-weighted loss, PPO that weighs a stale token's loss down, registered as --loss lag_ppo.

With async ratio alpha a trained token may come from a policy up to alpha versions behind the trainer.
PPO's ratio corrects for that only inside its clip range; a blunter idea is to trust old tokens less:
multiply each token's PPO loss by decay ** lag, where lag is how many versions the policy that sampled the
token is behind the trainer (lag 0: on-policy, full weight; decay 0.5: a token 2 versions old counts a
quarter).

A loss in this project is a function of `losses.Terms` (read its fields: `lp`, `old`, `r`, `A`, `m`,
`hp`, and per token `version` and `lag`) returning (per-token loss [B, T], extras), marked with
`@losses.loss` and registered in `losses.LOSSES` under the name `--loss` takes. Its own hyperparameters
are a dataclass given as `@loss(hparams=...)`: each field becomes a flag (--lag-decay) and reaches the
loss as `t.hp["lag_decay"]`. The trainer fills `Terms.lag` from each sample's per-token versions
(`model.collate`, called by `trainer.Trainer.train_step` with the trainer's version).

Implement lag_ppo: PPO's per-token loss (`losses.ppo`, your lab 2) times decay ** lag, passing PPO's extras
along (its `clipped` feeds the clip_frac metric); then register it as "lag_ppo" in `losses.LOSSES`.
docs/tour.md's section 5 is where a loss runs. Read `losses.ppo` and `losses.gspo` (a loss with its own
flags), docs/fork.md's "A loss" (another loss with a flag of its own), and `losses.compute_policy_loss` (what
it does around the loss: the mask, the aggregation). The grader checks it on toy tensors with known lags
against a hand computation, and through a real `trainer.Trainer` on the embedded tiny model.

    .venv/bin/python -m pytest labs/lab5_lag_loss_test.py
"""

from dataclasses import dataclass

from config import check, opt
from losses import LOSSES, Terms, loss, ppo  # noqa: F401  (what lag_ppo and its registration need)


@dataclass
class LagParams:
    lag_decay: float = opt(0.5, "lag_ppo: each token's loss times this ** its lag (versions behind)")

    def __post_init__(self):
        check(self, above=dict(lag_decay=0), at_most=dict(lag_decay=1))


@loss(hparams=LagParams)
def lag_ppo(t: Terms):
    raise NotImplementedError("lab 5: lag_ppo()")


# TODO (lab 5): register lag_ppo in losses.LOSSES under the name "lag_ppo" (what --loss lag_ppo looks up)
