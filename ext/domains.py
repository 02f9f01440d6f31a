"""ext/domains.py: several domains in one run (--domains FILE): ROLL's domain sampling and per-domain
tracking.

    bash run.sh --domains examples/domains.yaml          # addition (fast, one turn) + chain (three turns)
    domains:                                             # the file: a list of domains
      - {name: arith, source: embedded, weight: 0.6}
      - {name: chain, source: "env:chain", weight: 0.4, max_tokens: 8}

An entry: `name` (letters, digits, _ . -), `source`, `weight` (a positive number; the weights are
normalised), and optionally `reward`, `eval` and `max_tokens` (its reply budget per turn; default
--max-tokens). Sources: `embedded` (the addition task), `data:PATH` (JSONL or parquet rows as --data reads
them, math-verify), `task:NAME` (a reasoning-gym task), `env:NAME` (an env of rollout.ENVS: guess, chain,
calc; its problems are the embedded task's), `agent:MODULE:FN` (an OpenAI-client agent, as --agent runs one:
an endpoint per rank and domain). Reward: the source's own by default; `judge` (the run's --judge ranks: one
judge for every domain that names it); `none` (0: a teacher's signal alone); `module:function`. A source
whose env scores itself (guess, chain, an agent) takes no reward field. The teacher (--teacher) scores every
domain. `eval`: a held-out file for --eval-every; default the source's own held-out split (data: its last
--eval-prompts rows, kept out of training; else problems generated from a seed training never uses),
--eval-prompts of them per domain.

The mix, held (--domain-mix):
- quota (default; ROLL's domain-interleaved batches): each step's B groups hold q_d groups of domain d, q_d
  within one group of w_d x B (the remainder goes to the domains furthest behind their running ideal, so
  the mix is exact over steps too). A domain's ready groups beyond its quota do not count towards the B
  that end a step (Admission.eligible, a seam of the core): they wait for a later step, or go stale.
  Filtered, failed and stale groups are not trained, so they fill no quota. Admission first covers each
  domain's quota of this step (with its ready and running groups), then fills the async ratio's spare
  places by Little's law: a domain holds places in proportion to weight x its groups' measured time to
  complete / the share of them filtering keeps, so a slow domain gets the places it needs and a fast one's
  ready groups do not pile up and go stale. A step may wait for its slowest domain: the quota's price.
- admit: prompts admitted in proportion to the weights (smooth weighted round robin), and a step trains
  the first B groups ready, as naive async RL does: the trained mix drifts towards the domains that finish
  first and filter least.
Both keep the admission bound (the policy is a controller.Admission) and work with --redundant,
--filter-groups, --max-gen-batches, --env-redundancy (env and agent domains), --rollout-mode batch and the
streaming trainer. A domain that cannot fill its quota (--domain-patience of its groups in a row ended
untrained within a step: every group filtered, say) is named in a warning, once, and the other domains fill
its place in that step's batch; a domain whose samples all fail ends the run (a controller.FailureBreaker
per domain, on the controller's sample tap). Measured: results/domains.md (python -m tools.domains_study).

Tracked per step, for every domain, in metrics.jsonl: domain/NAME/weight, share (of the trained samples),
groups (trained), quota and short (quota mode), reward_mean, length_mean (response tokens),
staleness_mean, failed (its failed samples received), time_mean (seconds a trained trajectory took, from
its env's creation to its reward: this file's sample finisher sets meta["domain_s"] on the rollout rank);
with --eval-every, eval_greedy and eval_sampled per domain (ext/eval.py's ROUND_METRICS). A compact part of
the step line, the summary, a panel per domain in `python -m tools.plot` (domains.png), the trackers (every
numeric key of the row).

Seams of the core it uses (DESIGN.md#seams): task.Problem.env (a problem runs in its domain's env,
rollout.ENVS["domain:NAME"], training and held-out tasks alike), Admission.eligible (which ready groups a
step may take), ctrl.problem_of set before Admission.admitted; the hooks problem_source, admission,
on_controller (the sample tap), sample_finisher, after_step, step_line, on_row, summary_lines,
startup_lines; ext/eval.py's HELD_OUT and ROUND_METRICS.

Simplifications: a domain's own `module:function` reward runs on the rank's event loop (inline, as --reward
does without --reward-workers; the sources' own verifiers go through ext/verifiers.py's pool, one process a
rank by default when a data or task domain is there); a resumed run keeps its prompts in flight, but the
quota's running ideal starts afresh and the domains' streams do not go on exactly where they were; `env:`
and `agent:` domains draw the embedded task's problems.
"""

import collections
import contextvars
import dataclasses
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from buffer import now
from config import Extension, extension, opt
from controller import Admission, ControllerConfig, FailureBreaker
from rollout import ENVS, inline_reward
from task import Problem, load_dataset, load_reward, make_problem, make_problems, problem_stream
import task

FIELDS = ("name", "source", "weight", "reward", "eval", "max_tokens")
KINDS = ("embedded", "data", "task", "env", "agent")
VERIFIED_ENVS = ("", "calc")         # envs that score with the rank's verifier (a reward field applies)
HELD_OUT_SEED = 1_000_003            # ext/eval.py's: held-out problems from a seed training never uses
EMA = 0.1                            # the weight of a new measurement in a domain's time and kept share
KEPT_FLOOR = 0.2                     # a domain filtering keeps little of holds at most 1 / this x its places


# ---------------------------------------------------------------------------------------------
# the file


@dataclass
class Domain:
    name: str
    source: str
    weight: float                   # normalised: the domains' weights sum to 1
    reward: str = ""                # "" = the source's own; "judge"; "none"; "module:function"
    eval: str = ""                  # a held-out file; "" = the source's own held-out split
    max_tokens: int = 0             # reply budget per model turn; 0 = --max-tokens
    index: int = 0

    @property
    def kind(self) -> str:
        return self.source.split(":", 1)[0]

    @property
    def arg(self) -> str:
        return self.source.split(":", 1)[1] if ":" in self.source else ""

    @property
    def base_env(self) -> str:
        """The env of rollout.ENVS it runs in (agent: its own, registered by Domains)."""
        return {"env": self.arg, "agent": f"domain-agent:{self.name}"}.get(self.kind, "")

    @property
    def multi_turn(self) -> bool:
        return self.kind in ("env", "agent")

    @property
    def env(self) -> str:
        """Problem.env of its problems: this file's env for the domain (time, reward, budget)."""
        return f"domain:{self.name}"

    def problems(self, seed: int, held: int = 0) -> tuple:
        """(dataset rows for training or None, make(rng) -> Problem): data keeps its last `held` rows out when
        they are its held-out set."""
        if self.kind == "data":
            rows = load_dataset(self.arg)
            return (rows[:-held] if held and not self.eval else rows), make_problem
        if self.kind == "task":
            from ext.verifiers import reasoning_gym_maker
            return None, reasoning_gym_maker(self.arg, seed)
        return None, make_problem

    def held_out(self, seed: int, n: int) -> list[Problem]:
        """Its held-out problems: the eval file's first n; else data's last n rows, a task's or the embedded
        task's n problems generated from a seed training never uses."""
        if self.eval:
            return load_dataset(self.eval)[:n]
        if self.kind == "data":
            rows = load_dataset(self.arg)
            if len(rows) <= n:
                raise ValueError(f"--eval-every: domain {self.name!r}: data {self.arg} has {len(rows)} rows, "
                                 f"too few to hold out --eval-prompts {n}; give the domain an eval file")
            return rows[-n:]
        if self.kind == "task":
            import random
            from ext.verifiers import reasoning_gym_maker
            make = reasoning_gym_maker(self.arg, seed + HELD_OUT_SEED)
            return [make(random.Random(i)) for i in range(n)]
        return make_problems(n, seed=seed + HELD_OUT_SEED)

    def tag(self, p: Problem) -> Problem:
        """A problem of this domain: it runs in the domain's env and says whose it is."""
        return dataclasses.replace(p, env=self.env, meta={**p.meta, "domain": self.name})


def load_domains(path: str, cfg=None) -> list[Domain]:
    """The domains of a --domains file, checked; a ValueError names the file, the entry and the field. cfg
    (the run's Config): also checks what the run must provide (a judge reward needs --judge)."""
    import yaml
    where = f"--domains {path}"
    if not Path(path).is_file():
        raise ValueError(f"{where}: no such file")
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("domains"), list) or not doc["domains"]:
        raise ValueError(f"{where}: expected a mapping with a non-empty list `domains:` of entries (name, "
                         f"source, weight)")
    if extra := sorted(set(doc) - {"domains"}):
        raise ValueError(f"{where}: unknown top-level field(s) {', '.join(map(str, extra))}; only `domains:`")
    domains, seen = [], set()
    for i, e in enumerate(doc["domains"]):
        at = f"{where}: entry {i + 1}"
        if not isinstance(e, dict):
            raise ValueError(f"{at}: expected a mapping (name, source, weight), got {e!r}")
        if isinstance(e.get("name"), str):
            at += f" ({e['name']})"
        if unknown := sorted(set(map(str, e)) - set(FIELDS)):
            raise ValueError(f"{at}: unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
        for f in ("name", "source", "weight"):
            if f not in e:
                raise ValueError(f"{at}: field {f} is missing")
        d = _domain(e, at, i)
        if d.name in seen:
            raise ValueError(f"{at}: field name: {d.name!r} is a duplicate (another entry has it)")
        seen.add(d.name)
        _check_source(d, at)
        _check_reward(d, at, cfg)
        domains.append(d)
    total = sum(d.weight for d in domains)
    return [dataclasses.replace(d, weight=d.weight / total) for d in domains]


def _domain(e: dict, at: str, index: int) -> Domain:
    name, source, weight = e["name"], e["source"], e["weight"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"{at}: field name: {name!r} is not a name (letters, digits, _ . -)")
    if not isinstance(source, str) or source.split(":", 1)[0] not in KINDS:
        raise ValueError(f"{at}: field source: {source!r} is not a source; known: embedded, data:PATH, "
                         f"task:NAME, env:NAME, agent:MODULE:FN")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
            or weight <= 0:
        raise ValueError(f"{at}: field weight: {weight!r} is not a positive number")
    reward = e.get("reward", "")
    if not isinstance(reward, str):
        raise ValueError(f"{at}: field reward: {reward!r} is not judge, none or module:function")
    ev = e.get("eval", "")
    if not isinstance(ev, str):
        raise ValueError(f"{at}: field eval: {ev!r} is not a file")
    max_tokens = e.get("max_tokens", 0)
    if "max_tokens" in e and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                              or max_tokens < 1):
        raise ValueError(f"{at}: field max_tokens: {max_tokens!r} is not a positive integer")
    return Domain(name, source, float(weight), reward, ev, max_tokens, index)


def _rows(path: str, at: str):
    """A data file's rows, or a ValueError naming it (at: the entry and field)."""
    if not Path(path).is_file():
        raise ValueError(f"{at}: {path}: no such file")
    try:
        return load_dataset(path)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"{at}: {str(e).removeprefix('--data ')}") from None


def _check_source(d: Domain, at: str):
    """The source exists: a data file that reads, a reasoning-gym task, an env of rollout.ENVS, an agent that
    loads; and the eval file reads."""
    where = f"{at}: field source: {d.source!r}"
    if (d.kind == "embedded") == bool(d.arg):
        raise ValueError(f"{where}: " + ("embedded takes no argument" if d.arg else
                                         f"names no {'file' if d.kind == 'data' else 'name'}"))
    if d.kind == "data":
        _rows(d.arg, f"{at}: field source")
    elif d.kind == "task":
        from ext.verifiers import reasoning_gym_maker
        try:
            reasoning_gym_maker(d.arg, 0)
        except (ValueError, ImportError) as e:
            raise ValueError(f"{where}: {str(e).removeprefix(f'--task {d.arg!r}: ')}") from None
    elif d.kind == "agent":
        from ext.agent import load_agent
        try:
            load_agent(d.arg)
        except ValueError as e:
            raise ValueError(f"{where}: {str(e).removeprefix(f'--agent {d.arg!r}: ')}") from None
    elif d.kind == "env" and (d.arg not in ENVS or d.arg == "agent" or d.arg.startswith("domain")):
        known = sorted(k for k in ENVS if k and k != "agent" and not k.startswith("domain"))
        raise ValueError(f"{where}: env {d.arg!r} does not exist; known: {', '.join(known)}")
    if d.eval:
        _rows(d.eval, f"{at}: field eval")


def _check_reward(d: Domain, at: str, cfg):
    if not d.reward:
        return
    if d.kind == "agent" or (d.kind == "env" and d.arg not in VERIFIED_ENVS):
        raise ValueError(f"{at}: field reward: {d.source} scores its own trajectories; a reward field has "
                         f"nothing to score (drop it)")
    if d.reward == "judge":
        if cfg is not None and not getattr(cfg.ext.get("judge"), "judge", ""):
            raise ValueError(f"{at}: field reward: judge needs the run's judge: --judge DIR --judge-gpus K")
    elif d.reward != "none":
        try:
            load_reward(d.reward)
        except ValueError as e:
            raise ValueError(f"{at}: field reward: {str(e).removeprefix('--reward ')} (judge, none or "
                             f"module:function)") from None


# ---------------------------------------------------------------------------------------------
# the rollout side: each domain's env, its reward, its reply budget, its trajectories' time


TRAJECTORY: contextvars.ContextVar = contextvars.ContextVar("domain_trajectory", default=None)


class Budget:
    """An env with the domain's reply budget (max_tokens) as the base of every turn's sampling."""

    def __init__(self, env, max_tokens: int):
        self.env, self.max_tokens = env, max_tokens

    def __getattr__(self, name):
        return getattr(self.env, name)

    async def reset(self, seed: int):
        return await self.env.reset(seed)

    async def step(self, action: str):
        return await self.env.step(action)

    def sampling(self, s):
        s = dataclasses.replace(s, max_tokens=self.max_tokens)
        return self.env.sampling(s) if hasattr(self.env, "sampling") else s


class DrivingBudget:
    """An env that drives its own turns (an agent), with the domain's reply budget as its default."""

    def __init__(self, env, max_tokens: int):
        self.env, self.max_tokens = env, max_tokens

    def __getattr__(self, name):
        return getattr(self.env, name)

    async def run(self, proxy, fmt, cfg, task, traj, tag, meta, deadline):
        own = dataclasses.replace(cfg, max_tokens=self.max_tokens)
        return await self.env.run(proxy, fmt, own, task, traj, tag, meta, deadline)


async def finish(s):
    """(the sample finisher) The sample's domain and its trajectory's seconds, from its env's creation."""
    got = TRAJECTORY.get()
    if got is not None:
        s.meta["domain"], s.meta["domain_s"] = got[0], now() - got[1]


def register_envs(domains: list[Domain], judged: bool, model: str = "tiny-qwen2"):
    """rollout.ENVS["domain:NAME"] for every domain (in this process): the source's env with the domain's
    reward and budget; it notes the trajectory's start for the finisher."""
    for d in domains:
        if d.kind == "agent":
            from ext.agent import AgentEnv, Endpoint, load_agent
            fn, endpoint = load_agent(d.arg), Endpoint(model, 0)
            ENVS[d.base_env] = (lambda problem, seed, reward_fn=None, fn=fn, spec=d.arg, endpoint=endpoint:
                                AgentEnv(fn, spec, endpoint, problem))
        ENVS[d.env] = _env_factory(d, _reward(d, judged))


def _reward(d: Domain, judged: bool):
    """(the rank's reward_fn) -> the domain's: the rank's is a judge's when the run has one (in held-out
    evaluation the verifier), else the verifier pool or None (the task's verifier, inline)."""
    if d.reward == "judge":
        return lambda given: given
    if d.reward == "none":
        async def zero(problem, response):
            return 0.0
        return lambda given: zero
    if d.reward:
        own = inline_reward(load_reward(d.reward))
        return lambda given: own
    verifier = inline_reward(task.reward)
    return lambda given: verifier if judged else given


def _env_factory(d: Domain, reward):
    def make(problem, seed, reward_fn=None):
        TRAJECTORY.set((d.name, now()))
        env = ENVS[d.base_env](problem, seed, reward_fn=reward(reward_fn))
        if not d.max_tokens:
            return env
        return (DrivingBudget if hasattr(env, "run") else Budget)(env, d.max_tokens)
    return make


# ---------------------------------------------------------------------------------------------
# the controller side: the stream, the admission policy, the tracking


class Mix:
    """The problem stream of a mixture: each draw asks the policy (or, without one, the weights) which domain
    comes next, and takes that domain's stream's next problem, tagged with its domain."""

    def __init__(self, domains: list[Domain], streams: dict):
        self.domains = {d.name: d for d in domains}
        self.streams = streams            # name -> iterator of Problems (task.problem_stream)
        self.policy = None                # a DomainMix, once the controller has one
        self.drawn = collections.Counter()

    def by_weight(self) -> str:
        """Smooth weighted round robin over the draws: the domain furthest below its weight's share."""
        total = sum(self.drawn.values()) + 1
        return max(self.domains, key=lambda n: self.domains[n].weight * total - self.drawn[n])

    def make(self, rng=None) -> Problem:
        name = self.policy.choose() if self.policy is not None else self.by_weight()
        self.drawn[name] += 1
        return self.domains[name].tag(next(self.streams[name]))


def mix_of(domains: list[Domain], seed: int, held: int = 0) -> Mix:
    """The run's Mix: per domain its own endless stream (a shuffled pass over its rows, or generated), seeded
    apart."""
    streams = {}
    for d in domains:
        rows, make = d.problems(seed, held)
        streams[d.name] = problem_stream(rows, seed + 7919 * (d.index + 1), make=make)
    return Mix(domains, streams)


class DomainMix(Admission):
    """The mix, held (module docstring): --domain-mix quota or admit, as an Admission policy. It learns each
    group's domain from its problem when admitted (ctrl.problem_of), and keeps it (domain_of) for the samples
    and the batch."""

    KEEP = 100_000      # groups whose domain is remembered (admission order; far more than can be in flight)

    def __init__(self, cfg: ControllerConfig, domains: list[Domain], mix: Mix | None = None,
                 mode: str = "quota", patience: int = 0, spare: str = "little"):
        """spare: how quota mode fills the places its step's quotas leave: "little" (module docstring), or
        "weight" (places held in proportion to the weights alone: tools/domains_study.py's comparison)."""
        super().__init__(cfg)
        self.spare = spare
        self.w = {d.name: d.weight for d in domains}
        self.multi = {d.name for d in domains if d.multi_turn}
        self.mode, self.patience = mode, patience or 2 * cfg.batch_groups
        self.mix = mix or Mix(domains, {})
        self.mix.policy = self
        self.ctrl = None
        self.domain_of: dict[str, str] = {}
        self.active: set[str] = set()              # groups admitted, not yet trained or lost
        self.hold = collections.Counter()          # ... per domain: the places they hold
        self.trained = collections.Counter()       # groups trained, over the run
        self.steps = 0
        self.planned: dict[str, int] = {}          # this step's quotas as planned
        self.quota: dict[str, int] = {}            # ... as they stand (a short domain's given to the others)
        self.took = collections.Counter()          # groups taken into this step's batch
        self.short: set[str] = set()               # domains given up on in this step
        self.streak = collections.Counter()        # groups in a row ended untrained, this step
        self.warned: set[str] = set()
        self.shorts = collections.Counter()        # steps each domain was short in, over the run
        self.admitted_at: dict[str, float] = {}    # unfinished groups -> when admitted (loop time)
        self.latency: dict[str, float] = {}        # seconds from admission to complete (EMA)
        self.kept = {n: 1.0 for n in self.w}       # share of completed groups kept by filtering (EMA)
        self._taking = None
        self._changes = 0                          # quota or took changed: eligible's scan starts afresh
        self._scan = None                          # eligible's: [ready, scanned, changes, last, out, left]

    # --- which domain next
    def choose(self) -> str:
        if self.mode == "admit" or self.ctrl is None:
            return self.mix.by_weight()
        need = self.uncovered()
        if need:
            return max(need, key=lambda n: need[n] / self.w[n])
        prior = max(self.latency.values(), default=1.0)     # (not measured yet: as slow as the slowest)

        def filled(n):      # places held against the domain's share of them (one short now: by weight alone)
            if n in self.short or self.spare == "weight":
                return (self.hold[n] + 1) / self.w[n]
            return (self.hold[n] + 1) * self.kept[n] / (self.w[n] * self.latency.get(n, prior))
        return min(self.w, key=filled)

    def ready_of(self) -> collections.Counter:
        return collections.Counter(self.domain_of.get(g[0].group_id) for g in self.ctrl.assembler.ready)

    def uncovered(self) -> dict[str, int]:
        """This step's quota not yet covered by a domain's ready and running groups (domains given up on
        left out)."""
        out = {}
        for n, q in self.quota.items():
            left = q - self.took[n] - self.hold[n]       # (hold: its ready groups and its running ones)
            if left > 0 and n not in self.short:
                out[n] = left
        return out

    # --- Admission
    def capacity(self, ctrl) -> int:
        self.ctrl = ctrl
        return super().capacity(ctrl)

    def begin_step(self, ctrl) -> int:
        self.ctrl, self.steps = ctrl, self.steps + 1
        self.took.clear(), self.short.clear(), self.streak.clear()
        self.planned = self.plan(self.cfg.batch_groups) if self.mode == "quota" else {}
        self.quota, self._changes = dict(self.planned), self._changes + 1
        return 0

    def plan(self, B: int) -> dict[str, int]:
        """This step's quotas: floor(w_d B) each, the rest one each to the domains furthest behind their
        running ideal (w_d B per step so far, less what they trained)."""
        q = {n: math.floor(w * B + 1e-9) for n, w in self.w.items()}
        behind = sorted(self.w, key=lambda n: -(self.w[n] * B * self.steps - self.trained[n] - q[n]))
        for n in behind[:B - sum(q.values())]:
            q[n] += 1
        return q

    def admitted(self, gid: str, version: int) -> int:
        problem = self.ctrl.problem_of.get(gid) if self.ctrl is not None else None
        name = problem.meta.get("domain") if problem is not None else None
        if name not in self.w:
            raise ValueError(f"group {gid}: its problem belongs to no domain of --domains ({name!r}): a "
                             f"checkpoint of a run with other domains?")
        if len(self.domain_of) >= self.KEEP:            # forget the oldest half (long resolved)
            for g in list(self.domain_of)[:self.KEEP // 2]:
                del self.domain_of[g]
        self.domain_of[gid] = name
        self.active.add(gid)
        self.hold[name] += 1
        self.admitted_at[gid] = now()
        return self.cfg.group_size + (self.cfg.env_redundancy if name in self.multi else 0)

    def eligible(self, ready: list[list]) -> list[list]:
        self._completed(ready)
        if self.mode != "quota":
            return ready
        if len(self.short) == len(self.quota):          # every domain given up on: whatever is ready
            return ready
        # collect asks after every sample, and ready only grows between takes (the assembler appends; a take
        # or an eviction makes a new list): go on from where the last call stopped while nothing else changed
        # (freshest first sorts ready in place before its take: from the start)
        c = self._scan
        if (c is None or c[0] is not ready or c[1] > len(ready) or c[2] != self._changes
                or (c[1] and ready[c[1] - 1] is not c[3]) or self.cfg.sample_order == "freshest"):
            c = self._scan = [ready, 0, self._changes, None, [],
                              {n: q - self.took[n] for n, q in self.quota.items()}]
        _, start, _, _, out, left = c
        for g in itertools.islice(ready, start, None):
            n = self.domain_of.get(g[0].group_id)
            if left.get(n, 0) > 0:
                out.append(g)
                left[n] -= 1
        c[1], c[3] = len(ready), ready[-1] if ready else None
        return list(out)

    def taken(self, gid: str):
        self.took[self.domain_of[gid]] += 1
        self._taking, self._changes = gid, self._changes + 1

    def resolved(self, gid: str):
        if gid not in self.active:                      # (told again: a lost group's late samples)
            return
        self.active.discard(gid)
        name = self.domain_of[gid]
        self.hold[name] -= 1
        t0 = self.admitted_at.pop(gid, None)
        if gid == self._taking:                         # trained
            self._taking = None
            self.streak[name] = 0
            return
        if t0 is not None and gid not in self.ctrl.assembler.lost:     # completed and filtered
            self._measure(name, now() - t0, kept=False)
        self.streak[name] += 1
        if (self.mode == "quota" and name not in self.short and self.streak[name] >= self.patience
                and self.took[name] < self.quota.get(name, 0)):
            self._give_up(name)

    def _completed(self, ready: list[list]):
        """Groups seen ready for the first time (at ready's end, as the assembler appends them; collect asks
        after every sample): their time to complete, and kept."""
        for g in reversed(ready):
            gid = g[0].group_id
            if gid not in self.admitted_at:
                break
            self._measure(self.domain_of[gid], now() - self.admitted_at.pop(gid), kept=True)

    def _measure(self, name: str, seconds: float, kept: bool):
        old = self.latency.get(name)
        self.latency[name] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        self.kept[name] = max(KEPT_FLOOR, (1 - EMA) * self.kept[name] + EMA * kept)

    def _give_up(self, name: str):
        """A domain that cannot fill its quota this step: it keeps what it has (taken and ready), and the rest
        of its quota goes to the other domains by weight (largest remainder)."""
        self.short.add(name)
        self.shorts[name] += 1
        self._changes += 1
        have = self.took[name] + self.ready_of()[name]
        spare, self.quota[name] = self.quota[name] - have, have
        others = [n for n in self.quota if n not in self.short]
        if others and spare > 0:
            total = sum(self.w[n] for n in others)
            share = {n: spare * self.w[n] / total for n in others}
            add = {n: math.floor(share[n]) for n in others}
            for n in sorted(others, key=lambda n: add[n] - share[n])[:spare - sum(add.values())]:
                add[n] += 1
            for n in others:
                self.quota[n] += add[n]
        log = getattr(self.ctrl, "log", None)
        if log is not None and name not in self.warned:
            self.warned.add(name)
            log(f"domain {name}: {self.streak[name]} of its groups in a row ended untrained (filtered, "
                f"failed or stale) in step {self.steps}, with {have} of its quota of "
                f"{self.planned.get(name, 0)} groups: the other domains fill its place in this step's "
                f"batch (--domain-patience {self.patience}); said once, counted in domain/{name}/short. A "
                f"domain whose every group is filtered has rewards that never differ within a group: check "
                f"its reward, or --no-filter-groups")

    async def end_step(self, ctrl) -> dict:
        for n, k in self.took.items():
            self.trained[n] += k
        out = {f"domain/{n}/groups": self.took[n] for n in self.w}
        if self.mode == "quota":
            out.update({f"domain/{n}/quota": self.planned[n] for n in self.w})
            out.update({f"domain/{n}/short": int(n in self.short) for n in self.w})
        return out

    def counters(self, ctrl) -> dict:
        return {"domains": {n: {"groups_trained": self.trained[n], "steps_short": self.shorts[n]}
                            for n in self.w}}


class Tracker:
    """Per-domain figures of each step (metrics), the failures per domain (tap: the controller's sample tap, a
    FailureBreaker per domain), the run's totals for the summary."""

    def __init__(self, domains: list[Domain], policy: DomainMix, cfg: ControllerConfig,
                 who: str = "trainer rank 0"):
        self.domains, self.policy, self.who = domains, policy, who
        self.failed = collections.Counter()
        window = lambda d: max(2 * math.ceil(d.weight * cfg.batch_groups) * cfg.group_size, 64)  # noqa: E731
        self.breakers = {d.name: FailureBreaker(window(d), cfg.max_failed_share) for d in domains}
        self.rows: list[dict] = []

    async def tap(self, s) -> bool:
        """Every sample the controller receives: a failed one counts for its domain; a domain whose samples
        (nearly) all fail ends the run. Never takes the sample."""
        name = self.policy.domain_of.get(s.group_id)
        if name is None or s.notice or s.meta.get("eval"):
            return False
        self.failed[name] += s.failed
        self.breakers[name].add(s, f"{self.who}: domain {name}")
        return False

    def metrics(self, batch: list, version: int) -> dict:
        """The step's figures per domain; version: the trainer's when the batch was collected."""
        by = collections.defaultdict(list)
        for s in batch:
            by[self.policy.domain_of.get(s.group_id)].append(s)
        mean = lambda xs: sum(xs) / len(xs) if xs else None       # noqa: E731
        out = {}
        for d in self.domains:
            ss, k = by.get(d.name, []), f"domain/{d.name}"
            out.update({f"{k}/weight": d.weight, f"{k}/share": len(ss) / max(len(batch), 1),
                        f"{k}/reward_mean": mean([s.reward for s in ss]),
                        f"{k}/length_mean": mean([len(s.response_ids) for s in ss]),
                        f"{k}/staleness_mean": mean([version - s.oldest_version for s in ss]),
                        f"{k}/failed": self.failed[d.name],
                        f"{k}/time_mean": mean([s.meta["domain_s"] for s in ss if "domain_s" in s.meta])})
        self.failed.clear()
        return out


def domain_round_metrics(samples: list) -> dict:
    """(ext/eval.py's ROUND_METRICS) A held-out round per domain: greedy and temperature-1 mean reward."""
    by = collections.defaultdict(lambda: ([], []))
    for s in samples:
        if "domain" in s.meta:
            by[s.meta["domain"]][0 if s.task_id.endswith(".greedy") else 1].append(s.reward)
    return {f"domain/{n}/eval_{k}": sum(v) / len(v) for n, (g, t) in by.items()
            for k, v in (("greedy", g), ("sampled", t)) if v}


def held_out(cfg, seed: int, n: int):
    """(ext/eval.py's HELD_OUT) Every domain's held-out problems, n each, tagged; None without --domains."""
    part = cfg.ext.get("domains")
    if part is None or not part.domains:
        return None
    return [d.tag(p) for d in load_domains(part.domains) for p in d.held_out(seed, n)]


def _eval_hooks():
    from ext import eval as ev
    if domain_round_metrics not in ev.ROUND_METRICS:
        ev.ROUND_METRICS.append(domain_round_metrics)
    if held_out not in getattr(ev, "HELD_OUT", [held_out]):
        ev.HELD_OUT.append(held_out)


_eval_hooks()


# ---------------------------------------------------------------------------------------------
# the extension


@dataclass
class DomainsConfig:
    domains: str = opt("", "a YAML file of domains trained in one run, each with its source, weight, "
                           "reward, held-out set and reply budget (ext/domains.py; examples/domains.yaml); "
                           "empty = one source (--data, --task, --env or --agent)")
    domain_mix: str = opt("quota", "--domains: how the mix is held: quota (each step's batch holds each "
                                   "domain's share of its groups, within one group) | admit (prompts "
                                   "admitted by weight, the first groups ready trained: naive async RL)")
    domain_patience: int = opt(0, "--domains quota: a domain whose this many groups in a row ended untrained "
                                  "(filtered, failed, stale) within a step is short: the others fill its "
                                  "place in that step's batch, with a warning; 0 = 2 x --batch-groups")

    def __post_init__(self):
        if self.domain_mix not in ("quota", "admit"):
            raise ValueError(f"--domain-mix must be one of quota, admit, got {self.domain_mix!r}")
        if self.domain_patience < 0:
            raise ValueError(f"--domain-patience must be >= 0 (0 = 2 x --batch-groups), got "
                             f"{self.domain_patience}")


# flags that give a run its one source or reward, which --domains replaces: (flag, cfg -> its value)
ONE_SOURCE = (("--data", lambda c: c.data.data),
              ("--task", lambda c: getattr(c.ext.get("verifiers"), "task", "")),
              ("--env", lambda c: c.controller.env),
              ("--agent", lambda c: getattr(c.ext.get("agent"), "agent", "")),
              ("--reward", lambda c: c.rollout.reward),
              ("--eval-data", lambda c: getattr(c.ext.get("eval"), "eval_data", "")),
              ("--tail-batching", lambda c: getattr(c.ext.get("tail_batching"), "tail_batching", False)))
WHY = {"--tail-batching": "another admission policy", "--reward": "each domain names its reward",
       "--eval-data": "each domain names its held-out set (eval)"}


@extension
class Domains(Extension):
    name, Config = "domains", DomainsConfig
    order = -1          # its resolve before ext/verifiers.py's (--reward-workers' auto), its problem_source
                        # first (another's, a workload's lengths, then shapes the mixture's problems)

    @classmethod
    def wanted(cls, part) -> bool:
        return bool(part.domains)

    @classmethod
    def configure(cls, cfg, part):
        for flag, value in ONE_SOURCE:
            if value(cfg):
                why = WHY.get(flag, "each domain names its source")
                raise ValueError(f"--domains {part.domains} and {flag} {value(cfg)}: {why} (drop {flag})")
        load_domains(part.domains, cfg)

    def __init__(self, cfg, part):
        super().__init__(cfg, part)
        self.domains = load_domains(part.domains)
        self.policy = self.tracker = self.mix = None
        self.model = Path(cfg.model).name if cfg.model else "tiny-qwen2"
        register_envs(self.domains, bool(getattr(cfg.ext.get("judge"), "judge", "")), self.model)

    def resolve(self, cfg):
        """--reward-workers -1 (auto) with a data or task domain and no judge: one verifier process per
        rank, as ext/verifiers.py gives --data and --task (its pool scores by the problem's kind: every
        domain's own verifier)."""
        v = cfg.ext.get("verifiers")
        judged = bool(getattr(cfg.ext.get("judge"), "judge", ""))
        checked = any(d.kind in ("data", "task") for d in self.domains)
        if v is None or v.reward_workers != -1 or judged or not checked:
            return cfg
        one = dataclasses.replace(v, reward_workers=1)
        return dataclasses.replace(cfg, ext={**cfg.ext, "verifiers": one})

    def held(self) -> int:
        ev = self.cfg.ext.get("eval")
        return ev.eval_prompts if ev is not None and ev.eval_every > 0 else 0

    def problem_source(self, source, seed: int):
        self.mix = mix_of(self.domains, seed, self.held())
        if self.policy is not None:
            self.policy.mix, self.mix.policy = self.mix, self.policy
        return None, self.mix.make

    def admission(self, ctrl_cfg):
        p = self.part
        self.policy = DomainMix(ctrl_cfg, self.domains, self.mix, p.domain_mix, p.domain_patience)
        return self.policy

    def on_controller(self, ctrl, state):
        self.tracker = Tracker(self.domains, self.policy, ctrl.cfg)
        ctrl.taps.insert(0, self.tracker.tap)

    def sample_finisher(self, index: int, buffer):
        return finish

    def startup_lines(self, model_dir: str, device: str):
        return (f"domains ({self.part.domains}, --domain-mix {self.part.domain_mix}): "
                + ", ".join(f"{d.name} {d.weight:.0%} {d.source}"
                            + (f" reward {d.reward}" if d.reward else "")
                            + (f" max_tokens {d.max_tokens}" if d.max_tokens else "") for d in self.domains))

    async def after_step(self, ctrl, step: int, final: bool) -> dict:
        return self.tracker.metrics(ctrl.batch, ctrl.version - 1)

    def step_line(self, row: dict):
        parts = []
        for d in self.domains:
            k, r = f"domain/{d.name}", row.get(f"domain/{d.name}/reward_mean")
            if f"{k}/share" in row:
                parts.append(f"{d.name} {row[f'{k}/share']:.2f}" + (f" r{r:.2f}" if r is not None else ""))
        return " ".join(parts) or None

    def on_row(self, row: dict):
        if self.tracker is not None:
            self.tracker.rows.append({k: v for k, v in row.items() if k.startswith("domain/") or k == "step"})

    def summary_lines(self, runlog):
        rows = self.tracker.rows if self.tracker is not None else []
        if not rows:
            return None
        later = rows[5:] or rows                        # (the first 5 steps fill the pipeline)
        k5 = min(5, max(1, len(rows) // 2))             # first and last steps: apart when there are 2+

        def mean(key, rs):
            xs = [r[key] for r in rs if r.get(key) is not None]
            return sum(xs) / len(xs) if xs else float("nan")
        lines = []
        for d in self.domains:
            k = f"domain/{d.name}/"
            ev = [r[k + "eval_greedy"] for r in rows if r.get(k + "eval_greedy") is not None]
            lines.append(f"  domain     {d.name}: share {mean(k + 'share', later):.3f} of weight "
                         f"{d.weight:.3f} (steps {later[0]['step']}-{later[-1]['step']}), reward "
                         f"{mean(k + 'reward_mean', rows[:k5]):.3f} -> "
                         f"{mean(k + 'reward_mean', rows[-k5:]):.3f}, staleness "
                         f"{mean(k + 'staleness_mean', rows):.2f}, "
                         f"{mean(k + 'time_mean', rows):.2f}s a trajectory, "
                         f"{sum(r.get(k + 'failed') or 0 for r in rows)} failed"
                         + (f", held-out greedy {ev[0]:.3f} -> {ev[-1]:.3f}" if ev else ""))
        return lines
