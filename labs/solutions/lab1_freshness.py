"""Lab 1's reference: the project's own rule (buffer.Freshness.fresh) and bound
(controller.Admission.capacity), called with plain numbers."""

from types import SimpleNamespace

from buffer import Freshness
from controller import Admission, ControllerConfig


def fresh(oldest_version: int, version: int, async_ratio: int) -> bool:
    return Freshness(async_ratio).fresh(oldest_version, version)


def capacity(async_ratio: int, batch_groups: int, redundant: int, holding: int) -> int:
    cfg = ControllerConfig(batch_groups=batch_groups, redundant=redundant, async_ratio=async_ratio)
    ctrl = SimpleNamespace(freshness=Freshness(async_ratio), groups_holding_places=lambda: holding)
    return Admission(cfg).capacity(ctrl)      # (a controller stand-in: the two things capacity reads)
