"""config.py: typed configs as CLI flags, and sub-configs built from a top-level config.

    cfg = parse_cli(Config, doc=__doc__)                   # every dataclass field is a --flag
    ccfg = sub_config(ControllerConfig, cfg, timeout_s=60)  # the fields of the same name, + overrides

Each entry point (train.py, tools/sim.py) has one dataclass; each component (controller, env manager,
trainer) has its own and validates its own fields in __post_init__. sub_config copies the fields two
configs share by name, so a field is declared once per component, validated once by the component
that owns it, and never copied by hand.
"""

import argparse
import dataclasses


def opt(default, help: str, **metadata):
    """A config field with its --help text (metadata const=X: the flag alone means X)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def sub_config(cls, src, **overrides):
    """An instance of dataclass `cls` from the fields of `src` with the same names, then `overrides`.
    `cls` validates them (its __post_init__)."""
    names = {f.name for f in dataclasses.fields(cls)}
    shared = {f.name: getattr(src, f.name) for f in dataclasses.fields(src) if f.name in names}
    return cls(**{**shared, **overrides})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_cli(cls, argv=None, doc: str | None = None, positional: tuple[str, ...] = ()):
    """Parse argv into dataclass `cls`: one flag per field (bools get --x/--no-x), the field's
    metadata["help"] as help; the fields named in `positional` are required positional arguments
    instead (tools/plot.py RUN_DIR). A ValueError from the config's validation becomes a usage error."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        help = f.metadata.get("help", "")
        if f.name in positional:
            ap.add_argument(f.name, metavar=f.name.upper(), help=help)
        elif f.type in (bool, "bool"):
            ap.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=f.default, help=help)
        elif "const" in f.metadata:     # a flag that may stand alone: --resume means --resume yes
            ap.add_argument(flag(f.name), nargs="?", const=f.metadata["const"], default=f.default,
                            help=help + " (default: %(default)s)")
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            ap.add_argument(flag(f.name), type=typ, default=f.default, help=help + " (default: %(default)s)")
    try:
        return cls(**vars(ap.parse_args(argv)))
    except ValueError as e:
        ap.error(str(e))
