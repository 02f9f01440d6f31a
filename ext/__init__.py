"""ext/: every optional capability, one file each, plugged into the core's seams (config.Extension's hooks,
the registries of losses.py, rollout.py and weight_sync.py, controller's Admission and TrainBackend).

    import ext; ext.load()     # train.py and the tools, before flags are parsed: every file registers itself

A new capability is a new file here: an Extension subclass under @config.extension, its flags as a
dataclass, the hooks it needs. Nothing in the core names it.
"""

import importlib
import pkgutil


def load():
    """Import every module of this package (each registers its Extension, env, loss or transport)."""
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{m.name}")
