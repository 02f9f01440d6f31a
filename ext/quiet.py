"""ext/quiet.py: what a run prints by default (on unless --verbose): library logs at warning level, minus
known noise, on every rank and in the engine processes.

    quiet(verbose=False)    # first thing on every rank (Extension.before_launch), before vLLM loads

Left alone, a default run printed about 1,100 lines, 1,000 of them vLLM's INFO lines. quiet() changes only
this process's environment, which the engine processes (spawned later by the rollout rank) inherit: vLLM
at WARNING through a logging config that adds the filter KnownNoise (warnings in NOISE dropped, any other
warning shown once per text template and counted after that), Hugging Face progress bars off, the engine
processes' C++ warnings at error level and the Python warnings in PY_WARNINGS ignored. The engine
processes apply the same filter from their first line on (QUIET_MARK; see the end of this file: train.py,
re-imported there, loads ext/). Errors and every other warning still show; a variable the user set is
never overridden; --verbose turns it all off.

Each entry of NOISE was checked on this project's runs and is harmless here: "Failed to load weights"
(RotaryEmbedding, ParallelLMHead) at every weight sync, where vLLM's reload finds no checkpoint tensors for
layers that have none of their own (rotary) or are tied to the embedding (the worker refreshes the tied head
itself); "[shutdown] ... force killing", vLLM stopping its engine processes at the end of a run; the Triton /
Model Runner V2 / torch.compile / inductor notes, facts of the CPU build with enforce_eager; the
"libtcmalloc" / "libiomp is not found in LD_PRELOAD" allocator hints, which matter for large models on CPU,
not the tiny one; "Reset SSM cache type", a mamba setting (the model has no mamba layers).
"""

import hashlib
import json
import logging
import logging.config
import os
import tempfile
import warnings
from dataclasses import dataclass

from config import Extension, extension, opt

NOISE = (
    "Failed to load weights",
    "[shutdown]",
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed",
    "Model Runner V2 requires Triton",
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled",
    "is not found in LD_PRELOAD",
    "Reset SSM cache type",
)

# action:message:category:module (Python's -W syntax; the module must match in full)
PY_WARNINGS = (
    "ignore::FutureWarning:vllm.triton_utils.dispatcher",   # torch.distributed.reduce_op, inside vLLM
    # vLLM's shared memory queue, left when its worker is killed at exit
    "ignore:resource_tracker:UserWarning",
)


class KnownNoise(logging.Filter):
    """Drops the records in NOISE, and repeats of any other record's text template (record.msg,
    before its arguments are filled in), counting them in `repeats`."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()
        self.repeats = 0

    def filter(self, record: logging.LogRecord) -> bool:
        template = str(record.msg)
        if any(n in template for n in NOISE):
            return False
        if template in self.seen:
            self.repeats += 1
            return False
        self.seen.add(template)
        return True


def vllm_logging_config(level: str = "WARNING", noise="ext.quiet.KnownNoise") -> dict:
    """vLLM's logger hierarchy (the "vllm" logger) to stderr at `level`, through KnownNoise (noise: its
    dotted path, for the file vLLM reads; or the class itself), in vLLM's format less its process name
    (which needs vLLM's record factory, absent until vLLM configures logging itself; the pid tells the
    processes apart)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        # importable: vllm_engine.py puts this dir on PYTHONPATH
        "filters": {"known_noise": {"()": noise}},
        "formatters": {"vllm": {"format": "(vllm pid=%(process)d) %(levelname)s "
                                          "%(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                                "datefmt": "%m-%d %H:%M:%S"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": level,
                              "filters": ["known_noise"], "stream": "ext://sys.stderr"}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }


def write_config(config: dict) -> str:
    """The config as a JSON file vLLM can read; the path is named by the content, so every rank
    writes (or reuses) the same small file and none piles up."""
    text = json.dumps(config, indent=1)
    path = os.path.join(tempfile.gettempdir(),
                        f"roll-flash-nano-vllm-logging-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)          # atomic: a rank never reads a half-written file
    return path


QUIET_MARK = "ROLL_FLASH_QUIET"     # set by quiet(): this process and its children filter vLLM's logs


def _filter_now():
    """Apply the filter in this process at once, so that vLLM's import-time warnings (printed before
    vLLM configures its logging from VLLM_LOGGING_CONFIG_PATH) pass it too."""
    # (the class itself: this module may still be importing, as in the engine processes, where train.py's
    # import loads ext/ and this runs)
    level = os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")
    logging.config.dictConfig(vllm_logging_config(level, KnownNoise))


def quiet(verbose: bool = False):
    """Quiet defaults for this process and the processes it starts (module docstring)."""
    if verbose:
        return
    env = os.environ
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if "VLLM_LOGGING_CONFIG_PATH" not in env:
        env["VLLM_LOGGING_CONFIG_PATH"] = write_config(vllm_logging_config(env["VLLM_LOGGING_LEVEL"]))
        env[QUIET_MARK] = "1"
        _filter_now()
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if "PYTHONWARNINGS" not in env:
        env["PYTHONWARNINGS"] = ",".join(PY_WARNINGS)
        for spec in PY_WARNINGS:                      # this process too (PYTHONWARNINGS is read at start-up)
            action, message, category, module = (spec.split(":") + [""])[:4]
            warnings.filterwarnings(action, message, {"FutureWarning": FutureWarning,
                                                      "UserWarning": UserWarning}[category], module)


# vLLM's engine processes are spawned: each re-imports the main script (train.py, hence this module)
# before it imports vLLM. Where quiet() ran in an ancestor, filter here too, before vLLM's import.
if os.environ.get(QUIET_MARK) == "1":
    _filter_now()


@dataclass
class QuietConfig:
    verbose: bool = opt(False, "show every library log line (vLLM INFO, progress bars); default: warnings "
                               "and errors only")


@extension
class Quiet(Extension):
    name, Config = "quiet", QuietConfig
    order = -2          # before anything loads vLLM or transformers (--dry-run's plan does)

    def before_launch(self):
        quiet(self.part.verbose)

    def engine_args(self, model_dir: str, device: str, who: str):
        return {"use_tqdm_on_load": self.part.verbose}   # vLLM's "Loading safetensors checkpoint shards"
