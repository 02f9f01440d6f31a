"""config.py: typed configs as CLI flags. Each component owns a dataclass (its fields, defaults, --help and
validation); an entry point's config composes them, and every leaf field becomes one flat --flag.

    @dataclass
    class Config:
        steps: int = opt(80, "training steps")                  # the entry point's own setting
        controller: ControllerConfig = part(ControllerConfig)   # --batch-groups, --async-ratio, ...
    cfg = parse_cli(Config, doc=__doc__)                        # cfg.controller.async_ratio

A flag name declared twice (by the entry point and a part, or by two parts) is an error when the parser is
built: every setting has one declaration, one default and one validator.
"""

import argparse
import dataclasses


def opt(default, help: str, **metadata):
    """A config field with its --help text (metadata const=X: the flag alone means X)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def part(cls):
    """A component's config inside an entry point's config: its fields become flags of their own."""
    return dataclasses.field(default_factory=cls, metadata={"part": True})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def leaf_fields(cls, owner: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(owner path, field) for every flag of `cls`: its own fields, then its parts' fields, recursively.
    Raises if two of them share a name (one declaration per setting)."""
    out, seen = [], {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("part"):
            sub = leaf_fields(f.default_factory, f"{owner}{f.name}.")
        else:
            sub = [(owner, f)]
        for path, g in sub:
            if g.name in seen:
                raise TypeError(f"{flag(g.name)} is declared twice: {seen[g.name]}{g.name} and "
                                f"{path}{g.name}")
            seen[g.name] = path
            out.append((path, g))
    return out


def _build(cls, values: dict):
    """`cls` from the flat parsed values; parts are built (and validate themselves) first."""
    kw = {}
    for f in dataclasses.fields(cls):
        kw[f.name] = _build(f.default_factory, values) if f.metadata.get("part") else values[f.name]
    return cls(**kw)


def parse_cli(cls, argv=None, doc: str | None = None, positional: tuple[str, ...] = ()):
    """Parse argv into dataclass `cls`: one flag per leaf field (bools get --x/--no-x), the field's
    metadata["help"] as help; the fields named in `positional` are required positional arguments
    instead (tools/plot.py RUN_DIR). A ValueError from a config's validation becomes a usage error."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sections = {}       # --help lists each part's flags under its name
    for path, f in leaf_fields(cls):
        help = f.metadata.get("help", "")
        sec = sections.setdefault(path, ap.add_argument_group(path.rstrip(".")) if path else ap)
        if f.name in positional:
            sec.add_argument(f.name, metavar=f.name.upper(), help=help)
        elif f.type in (bool, "bool"):
            sec.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=f.default,
                             help=help)
        elif "const" in f.metadata:     # a flag that may stand alone: --resume means --resume yes
            sec.add_argument(flag(f.name), nargs="?", const=f.metadata["const"], default=f.default,
                             help=help + " (default: %(default)s)")
        else:
            typ = ({"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str)
                   else f.type)
            sec.add_argument(flag(f.name), type=typ, default=f.default, help=help + " (default: %(default)s)")
    try:
        return _build(cls, vars(ap.parse_args(argv)))
    except ValueError as e:
        ap.error(str(e))
