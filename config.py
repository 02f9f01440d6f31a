"""config.py: typed configs as CLI flags, and the extensions that bring their own.

Each component owns a dataclass (its fields, defaults, --help and validation); an entry point's config
composes them, and every leaf field becomes one flat --flag:

    @dataclass
    class Config:
        steps: int = opt(80, "training steps")                  # the entry point's own setting
        controller: ControllerConfig = part(ControllerConfig)   # --batch-groups, --async-ratio, ...
        ext: dict = extensions()                                # every ext/ file's flags: cfg.ext["lora"]
    cfg = parse_cli(Config, doc=__doc__)                        # cfg.controller.async_ratio

A flag name declared twice (by the entry point and a part, or by two parts) is an error when the parser is
built: every setting has one declaration, one default and one validator.

An optional capability is one file in ext/ holding an Extension subclass, registered with @extension: its
flags (Config) and the hooks it fills in. The core calls the hooks (train.py asks Extensions for them),
and never looks at an extension's flags. Which hooks exist and why: DESIGN.md#seams. The same mechanism,
registry(), gives a loss its own flags (losses.LossConfig's hparams: each entry of LOSSES that declares
some): whatever a registry holds when the parser is built brings its dataclass's fields as flags.
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


def check(cfg, at_least: dict = {}, above: dict = {}, one_of: dict = {}, at_most: dict = {},
          below: dict = {}):
    """A config's validation, naming the flag: each field of at_least >= its value, of above > its value,
    of at_most <= its value, of below < its value, of one_of among its values (NaN, or a value that does not
    compare, fails)."""
    tests = ([(n, lambda v, x=x: v >= x, f">= {x}") for n, x in at_least.items()]
             + [(n, lambda v, x=x: v > x, f"> {x}") for n, x in above.items()]
             + [(n, lambda v, x=x: v <= x, f"<= {x}") for n, x in at_most.items()]
             + [(n, lambda v, x=x: v < x, f"< {x}") for n, x in below.items()]
             + [(n, lambda v, x=x: v in x, f"one of {', '.join(map(str, x))}") for n, x in one_of.items()])
    for name, ok, what in tests:
        value = getattr(cfg, name)
        try:
            good = ok(value)
        except TypeError:
            good = False
        if not good:
            raise ValueError(f"{flag(name)} must be {what}, got {value!r}")


def registry(classes):
    """A field holding one config per entry of a registry, {name: its config}; classes() -> {name: config
    class}, read when the flags are built, so whatever registered by then brings its flags (extensions(),
    losses.LossConfig's hparams)."""
    return dataclasses.field(default_factory=lambda: {n: c() for n, c in classes().items()},
                             metadata={"registry": classes})


# ---------------------------------------------------------------------------------------------
# extensions

EXTENSIONS: dict[str, type] = {}    # name -> Extension subclass, in the order ext/ registered them


def extension(cls):
    """Class decorator of an ext/ file's Extension: registered under cls.name."""
    if not cls.name or cls.name in EXTENSIONS:
        raise TypeError(f"extension {cls.__name__}: name {cls.name!r} is empty or taken")
    EXTENSIONS[cls.name] = cls
    return cls


def extensions():
    """The entry point's field holding every registered extension's flags: {name: its Config}."""
    return registry(lambda: {n: c.Config for n, c in EXTENSIONS.items() if c.Config})


class Extension:
    """An optional capability: one instance per process, made only when its flags ask for it (wanted). The
    core asks the run's Extensions for each hook below at the point listed (train.py; Extensions.call,
    first, chain, acall: in (order, registration) order); an extension defines the hooks it needs, and one
    it does not define answers None ("nothing from me"). The few with a default, defined below, are called
    on every extension (configure, before_train, extra_ranks, run_extra_rank) or pass a value on (resolve,
    problem_source).

    launch (train.py main, every rank):
        def before_launch(self)
            Before any process group starts; may exit (--dry-run).
        def embedded_model(self)
            With no --model: a builder of the embedded model to use, (log) -> its dir (an env's own).
        def start_from(self, base_dir, ckpt, state)
            The model dir the run's weights start from, if not the checkpoint's (resume) or the base's.
        def startup_lines(self, model_dir, device) -> str
            Text rank 0 prints at start-up (the memory plan).
        def without_torchrun(self)
            python train.py without torchrun: run(cfg, exts, extra_ranks, the train module), the whole run
            in one process (ext/one_process.py).
    trainer ranks:
        def trainer_weights(self)
            What the trainer trains, syncs and saves, if not the whole model (trainer.Weights).
        def after_train(self, trainer)
            Every trainer rank, after each batch trained.
    trainer rank 0: the problems, the controller, the loop:
        def problem_maker(self, seed)
            make(rng) -> Problem for generated problems, if not the default task's (--task).
        def held_out(self, problems, seed)
            (training problems, held-out problems), if some are held out (--eval-every).
        def admission(self, ctrl_cfg)
            Which prompts run and when (controller.Admission), if not the async ratio's own.
        def freshness(self, ctrl_cfg)
            The freshness rule (buffer.Freshness), if not --async-ratio's fixed bound: an adaptive one.
        def train_backend(self, ranks, probe_due)
            How a step's groups are trained (controller.TrainBackend), if not as one whole batch.
        def on_controller(self, ctrl, state)
            The controller is built (state: the checkpoint's on a resume): taps, events, trackers.
        def sync_recovery(self)
            What the controller does when a broadcast fails or an engine is replaced (ext/recovery.py).
        async def after_step(self, ctrl, step, final) -> dict
            After each step's sync: metrics to add to its row (evaluation).
        def on_ready(self, t)
            The engines are up (time.time()).
        def on_row(self, row)
            A step's row of metrics.jsonl (trackers, the timeline's flush).
        def step_line(self, row) -> str
            What the step's progress line adds.
        def summary_lines(self, runlog) -> list[str]
            Lines of the end-of-run summary.
        def run_files(self) -> list[str]
            Files the run wrote, for the summary.
        def on_finish(self)
            The run ended (before the summary).
        def close(self)
            At the end of the run, whatever happened; idempotent.
    rollout ranks:
        def engine_args(self, model_dir, device, who) -> dict
            Keywords for the engine's start (vllm_engine.VLLMEngine.start, AsyncEngineArgs').
        def rollout_engine(self, model_dir, who, engine)
            An awaitable of the rollout rank's engine (proxy.Engine), if not vLLM's (ext/torch_engine.py's
            --engine torch); engine: vllm_engine.VLLMEngine.start's keywords.
        def on_engine(self, engine)
            Every new engine (vllm_engine.VLLMEngine), once started.
        def on_proxy(self, proxy, index, t_start)
            The rank's proxy is up (its engine started at t_start, time.time()).
        def engine_recovery(self, restart_engine)
            What replaces this rank's engine when it dies (ext/recovery.py); restart_engine() -> a new one.
        def env_wrapper(self, index)
            (env) -> env, for every env rollout rank `index` makes (injected faults).
        def scorer(self, index, buffer)
            What scores rollout rank `index`'s answers, if not inline: async score(problem, response),
            stats(), shutdown() (a verifier pool, an LLM judge).
        def sample_finisher(self, index, buffer)
            async (Sample) -> None, run on every finished sample of rollout rank `index` before it is sent,
            in the trajectory's own task (a teacher's per-token log-probs into its token_fields, a judge's
            record); an EnvFailure fails the attempt. Every extension's, in order.
        def env_deadline(self)
            The env calls' deadline (rollout.FixedDeadline's interface), if not --env-step-timeout-s."""
    name = ""
    Config = None                       # its flags: a dataclass, cfg.ext[name]
    order = 0                           # hooks are called in (order, registration) order

    def __init__(self, cfg, part):
        self.cfg, self.part = cfg, part

    @classmethod
    def wanted(cls, part) -> bool:
        """Do these flags turn it on? (An extension without flags is always on.)"""
        return True

    @classmethod
    def configure(cls, cfg, part):
        """At parse time: raise ValueError naming the flags that do not fit the rest of cfg; may settle a
        core setting left "auto" (--weight-transport)."""

    def resolve(self, cfg):
        """At launch: cfg with settings of its own resolved (defaults that depend on the model, the task, the
        env)."""
        return cfg

    def extra_ranks(self) -> int | None:
        """How many ranks this extension adds after the rollout ranks, each running an engine of its own (a
        teacher's, a judge's): torchrun starts them too (train.py --print-world-size counts them)."""

    def run_extra_rank(self, index: int, device: str, engine_core: str, buffer_addr: tuple, state):
        """Run this extension's rank `index` (0.. of its extra_ranks) until the run ends; buffer_addr: the
        queue server's (host, port, authkey), where it meets the rollout ranks. engine_core is "" (on CPU the
        rank runs on the host cores the other ranks share, and places its engine itself: ext/served.py)."""

    def problem_source(self, source: tuple, seed: int) -> tuple:
        """Trainer rank 0: (problems or None, make) as training draws them (a workload's lengths)."""
        return source

    async def before_train(self, ctrl):
        """Trainer rank 0: before each whole batch trains (--colocate: the engines sleep)."""


class Extensions(list):
    """The extensions a run's flags turn on."""

    @classmethod
    def start(cls, cfg) -> "Extensions":
        on = [c(cfg, cfg.ext.get(n)) for n, c in EXTENSIONS.items() if c.wanted(cfg.ext.get(n))]
        return cls(sorted(on, key=lambda e: e.order))

    @staticmethod
    def configure(cfg):
        for n, c in EXTENSIONS.items():
            if c.wanted(cfg.ext.get(n)):
                c.configure(cfg, cfg.ext.get(n))

    def call(self, hook: str, *args) -> list:
        """Every extension's answer to hook(*args), None left out."""
        return [r for e in self if hasattr(e, hook) and (r := getattr(e, hook)(*args)) is not None]

    def chain(self, hook: str, *args):
        """The async functions every extension's hook(*args) gives, as one that awaits each in turn (None:
        none gave one)."""
        fns = self.call(hook, *args)

        async def each(*a):
            for fn in fns:
                await fn(*a)
        return each if fns else None

    def first(self, hook: str, *args):
        """The one extension that answers hook(*args), or None; two answering is an error."""
        got = [(e.name, r) for e in self if hasattr(e, hook) and (r := getattr(e, hook)(*args)) is not None]
        if len(got) > 1:
            raise ValueError(f"{' and '.join(n for n, _ in got)} both provide {hook}: pick one")
        return got[0][1] if got else None

    async def acall(self, hook: str, *args) -> list:
        return [r for e in self if hasattr(e, hook) and (r := await getattr(e, hook)(*args)) is not None]

    def fold(self, hook: str, value, *args):
        """value passed through every extension's hook(value, *args) in turn."""
        for e in self:
            value = getattr(e, hook)(value, *args)
        return value

    def resolve(self, cfg):
        """cfg through every extension's resolve; each then sees the result."""
        return self.update(self.fold("resolve", cfg))

    def update(self, cfg):
        for e in self:
            e.cfg, e.part = cfg, cfg.ext.get(e.name)
        return cfg


# ---------------------------------------------------------------------------------------------
# flags


def leaf_fields(cls, owner: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(owner path, field) for every flag of `cls`: its own fields, then its parts' fields, recursively.
    Raises if two of them share a name (one declaration per setting)."""
    out, seen = [], {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("part"):
            sub = leaf_fields(f.default_factory, f"{owner}{f.name}.")
        elif classes := f.metadata.get("registry"):
            sub = [x for n, c in classes().items() for x in leaf_fields(c, f"{owner}{f.name}.{n}.")]
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
        if f.metadata.get("part"):
            kw[f.name] = _build(f.default_factory, values)
        elif classes := f.metadata.get("registry"):
            kw[f.name] = {n: _build(c, values) for n, c in classes().items()}
        else:
            kw[f.name] = values[f.name]
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
