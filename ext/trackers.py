"""ext/trackers.py: --tracker tensorboard | wandb | trackio. Every numeric key of each metrics.jsonl row goes
there too, on trainer rank 0 (Extension.on_row); a missing optional package is named when the flags are
parsed, before any process starts. tensorboard writes out_dir/tensorboard/ (tensorboard --logdir OUT_DIR);
wandb and trackio need `pip install wandb` or `trackio` first.
"""

import dataclasses
import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

from config import Extension, extension, opt

# --tracker NAME -> the package it needs (None: nothing to install)
TRACKERS = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def check_tracker(name: str):
    """Raise ValueError naming the package to install when --tracker NAME cannot work here."""
    if name not in TRACKERS:
        raise ValueError(f"--tracker must be one of {', '.join(TRACKERS)}, got {name!r}")
    package = TRACKERS[name]
    if package and importlib.util.find_spec(package) is None:
        raise ValueError(f"--tracker {name} needs the optional package {package!r}, which is not installed: "
                         f"pip install {package}   (or use --tracker none; metrics.jsonl is always written)")


@dataclass
class TrackerConfig:
    tracker: str = opt("none", "also send metrics.jsonl's rows to: none | tensorboard | wandb | trackio "
                               "(rank 0)")
    tracker_project: str = opt("roll-flash-nano", "project for --tracker wandb / trackio (the run: "
                                                  "out_dir's name)")

    def __post_init__(self):
        check_tracker(self.tracker)        # a missing optional package is named now, before anything starts


class TensorBoardTracker:
    """Scalars in out_dir/tensorboard (tensorboard --logdir OUT_DIR/tensorboard)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter    # needs the tensorboard package
        self.writer = SummaryWriter(str(log_dir))

    def log(self, metrics: dict, step: int):
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()              # visible to a running tensorboard at once

    def close(self):
        self.writer.close()


class WandbLikeTracker:
    """wandb, or trackio (which copies wandb's init / log / finish)."""

    def __init__(self, module_name: str, project: str, name: str, config: dict, out_dir: Path):
        self.module_name = module_name
        self.mod = __import__(module_name)
        kwargs = {"dir": str(out_dir)} if module_name == "wandb" else {}
        self.mod.init(project=project, name=name, config=config, **kwargs)

    def log(self, metrics: dict, step: int):
        if self.module_name == "wandb":
            self.mod.log(metrics, step=step)
        else:
            self.mod.log(metrics)        # trackio counts one step per call; the row's "step" key is there too

    def close(self):
        self.mod.finish()


def scalars(row: dict) -> dict:
    """The numeric keys of a metrics row (what trackers get)."""
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@extension
class Trackers(Extension):
    name, Config = "trackers", TrackerConfig
    tracker = None

    @classmethod
    def wanted(cls, part) -> bool:
        return part.tracker != "none"

    def on_controller(self, ctrl, state):
        """Rank 0 starts the tracker (a fresh run: old tensorboard files go)."""
        out, name = Path(self.cfg.out_dir), self.part.tracker
        if name == "tensorboard":
            if state is None:
                shutil.rmtree(out / "tensorboard", ignore_errors=True)
            self.tracker = TensorBoardTracker(out / "tensorboard")
        else:
            self.tracker = WandbLikeTracker(name, self.part.tracker_project, out.name,
                                            dataclasses.asdict(self.cfg), out)

    def on_row(self, row: dict):
        if self.tracker is not None:
            self.tracker.log(scalars(row), row["step"])

    def run_files(self):
        return [str(Path(self.cfg.out_dir) / "tensorboard")] if self.part.tracker == "tensorboard" else None

    def close(self):
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
