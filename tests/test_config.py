"""config.py: flags from composed configs, one declaration per setting."""

import dataclasses
from dataclasses import dataclass

import pytest

from config import leaf_fields, opt, parse_cli, part


@dataclass
class Inner:
    width: int = opt(3, "an inner setting")

    def __post_init__(self):
        if self.width < 1:
            raise ValueError(f"--width must be >= 1, got {self.width}")


@dataclass
class Outer:
    steps: int = opt(5, "an entry point's own setting")
    inner: Inner = part(Inner)


def test_parts_become_flat_flags_and_validate_themselves(capsys):
    cfg = parse_cli(Outer, ["--width", "7", "--steps", "2"])
    assert cfg == Outer(steps=2, inner=Inner(width=7))
    assert parse_cli(Outer, []).inner.width == 3                  # the part's own default
    with pytest.raises(SystemExit):
        parse_cli(Outer, ["--width", "0"])
    assert "--width must be >= 1, got 0" in capsys.readouterr().err  # the part's error, as a usage error


def test_a_flag_declared_twice_is_an_error():
    @dataclass
    class Twice:
        width: int = opt(1, "declared again by the entry point")
        inner: Inner = part(Inner)
    with pytest.raises(TypeError, match="--width is declared twice: width and inner.width"):
        parse_cli(Twice, [])


def test_train_config_composes_the_components_without_copying_them():
    """Every train.py flag is declared once, and its default is its owner's own."""
    from controller import ControllerConfig
    from env_manager import RolloutConfig
    from losses import VARIANTS, LossConfig
    from train import Config
    from trainer import TrainConfig
    flags = [f.name for _, f in leaf_fields(Config)]
    assert len(flags) == len(set(flags))
    cfg = parse_cli(Config, [])
    for part_cfg, cls in ((cfg.controller, ControllerConfig), (cfg.rollout, RolloutConfig),
                          (cfg.train, TrainConfig)):
        assert part_cfg == cls()
    own = {f.name for f in dataclasses.fields(Config)}
    for cls in (ControllerConfig, RolloutConfig, TrainConfig):
        assert not own & {f.name for f in dataclasses.fields(cls)}
    loss_help = next(f for _, f in leaf_fields(Config) if f.name == "loss").metadata["help"]
    assert all(v in loss_help for v in VARIANTS)
    assert {f.name for f in dataclasses.fields(LossConfig)} <= set(flags)
