"""Lab 4's reference: SyncFirst, the async part left to the project's own controller.Admission.capacity."""

from controller import Admission


class SyncFirst(Admission):
    def __init__(self, cfg, n: int):
        super().__init__(cfg)
        self.n = n

    def capacity(self, ctrl) -> int:
        if ctrl.version - ctrl.version0 >= self.n:
            return super().capacity(ctrl)                     # (alpha + 1) * B + redundant - held
        return self.cfg.batch_groups + self.cfg.redundant - ctrl.groups_holding_places()
