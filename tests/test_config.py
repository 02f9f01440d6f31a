"""config.py: flags from composed configs, one declaration per setting."""

import dataclasses
from dataclasses import dataclass

import pytest

from config import leaf_fields, opt, parse_cli, part, registry

pytestmark = pytest.mark.fast


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
    assert {f.name for _, f in leaf_fields(LossConfig)} <= set(flags)


@dataclass
class Other:
    depth: float = opt(0.5, "another entry's setting")


def test_a_registrys_entries_bring_their_own_flags_when_the_parser_is_built(capsys):
    """registry(): one config per entry, each field a flag, read at parse time (an entry registered after
    the entry point's class was defined brings its flags too); validated by its own class; a flag declared
    twice is an error."""
    entries = {"a": Inner}

    @dataclass
    class Point:
        steps: int = opt(5, "an entry point's own setting")
        parts: dict = registry(lambda: dict(entries))
    entries["b"] = Other
    cfg = parse_cli(Point, ["--width", "4", "--depth", "0.25"])
    assert cfg.parts == {"a": Inner(width=4), "b": Other(depth=0.25)} and Point().parts["b"] == Other()
    assert [p for p, f in leaf_fields(Point) if f.name == "depth"] == ["parts.b."]
    with pytest.raises(SystemExit):
        parse_cli(Point, ["--width", "0"])
    assert "--width must be >= 1, got 0" in capsys.readouterr().err
    entries["c"] = Inner
    with pytest.raises(TypeError, match="--width is declared twice: parts.a.width and parts.c.width"):
        parse_cli(Point, [])


def test_each_losss_own_flags_keep_their_names_defaults_and_checks(capsys):
    """The losses' own hyperparameters (@loss(hparams=...), beside each loss) are train.py flags as before;
    the chosen loss's reach compute_policy_loss's keywords, another's do not."""
    from train import Config
    fields = {f.name: f for _, f in leaf_fields(Config)}
    want = dict(tis_cap=2.0, cispo_low=1.0, cispo_high=0.28, topr_pos_weight=1.0, topr_neg_weight=1.0,
                behav_weight_cap=0.0, gspo_clip_low=3e-4, gspo_clip_high=4e-4)
    assert {n: fields[n].default for n in want} == want
    kw = parse_cli(Config, ["--loss", "tis", "--tis-cap", "1.5", "--cispo-high", "0.1"]).train.loss_kwargs()
    assert kw["tis_cap"] == 1.5 and "cispo_high" not in kw and kw["clip_high"] == 0.28
    assert parse_cli(Config, ["--loss", "gspo"]).train.loss_kwargs()["gspo_clip_low"] == 3e-4
    for name, value in (("--tis-cap", "0"), ("--topr-neg-weight", "nan"), ("--behav-weight-cap", "-1"),
                        ("--gspo-clip-low", "2"), ("--dual-clip", "0.5")):
        with pytest.raises(SystemExit):
            parse_cli(Config, [name, value])
        assert f"{name} must be" in capsys.readouterr().err
