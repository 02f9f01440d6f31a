"""ext/eval.py: held-out accuracy every --eval-every versions and at the end (greedy, and mean@k: the mean
reward of --eval-k samples at temperature 1 per prompt), through the same engines, never trained on.

    ev = Evaluation(ctrl)                    # taps the controller's samples (AsyncController.taps)
    await ev.start(problems, k)              # one round at the current version
    result = ev.result()                     # {} until every sample of the round is in, then once
    result = await ev.finish()               # wait for it (training samples meanwhile: left unconsumed)

The held-out set: --eval-data if given; else the last --eval-prompts rows of --data (kept out of
training); else generated problems from a seed training never uses. Evaluation tasks are never aborted
as stale (buffer.RolloutTask.eval_temperature); one a rank aborts on its own (--colocate's SLEEP) runs
again, so a round always completes.
"""

import random
from dataclasses import dataclass

from buffer import RolloutTask
from config import Extension, extension, opt
from ext.verifiers import reasoning_gym_maker
from runlog import print0
from task import load_dataset, make_problems


@dataclass
class EvalConfig:
    eval_every: int = opt(0, "held-out accuracy (greedy and mean@k) every N versions and at the end; "
                             "0 = never")
    eval_data: str = opt("", "held-out JSONL/parquet; default: the last --eval-prompts rows of --data, or "
                             "generated problems from a seed training never uses")
    eval_prompts: int = opt(64, "held-out prompts per evaluation")
    eval_k: int = opt(4, "samples per held-out prompt at temperature 1 (mean@k)")

    def __post_init__(self):
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0, got {self.eval_every}")
        if self.eval_prompts < 1 or self.eval_k < 1:
            raise ValueError(f"--eval-prompts and --eval-k must be >= 1, got {self.eval_prompts}, "
                             f"{self.eval_k}")


# what other extensions measure on a round's held-out samples, beside its accuracy: f(the round's samples,
# failed ones left out) -> metrics merged into its result (ext/distill.py: eval_teacher_kl)
ROUND_METRICS: list = []
# another extension's held-out set in place of the default: f(cfg, seed, n) -> problems, or None when it has
# none for this run (ext/domains.py: each domain's own, n each)
HELD_OUT: list = []


class Evaluation:
    """Evaluation rounds over a controller's engines (module docstring)."""

    def __init__(self, ctrl):
        self.ctrl, self.round = ctrl, None
        ctrl.taps.append(self.tap)

    async def start(self, problems: list, k: int):
        """Admit one round at the current version: every problem once greedy and k times at temperature 1.
        Skipped while the previous round is still running."""
        if self.round is not None:
            return
        v, tasks = self.ctrl.version, []
        for i, p in enumerate(problems):
            gid = f"eval{v}.{i}"
            tasks.append(RolloutTask(f"{gid}.greedy", gid, p, 1, v, "", eval_temperature=0.0))
            tasks += [RolloutTask(f"{gid}.t{j}", gid, p, 1, v, "", eval_temperature=1.0) for j in range(k)]
        self.round = {"version": v, "k": k, "left": len(tasks), "greedy": [], "sampled": [], "samples": [],
                      "tasks": {t.task_id: t for t in tasks}}
        await self.ctrl.buffer.put_tasks(tasks)

    async def tap(self, s) -> bool:
        """The controller's sample tap: True when s is an evaluation sample (taken here, never trained)."""
        if not s.meta.get("eval"):
            return False
        r = self.round
        if r is None or s.task_id not in r["tasks"] or (s.failed and s.meta.get("retrying")):
            return True                                 # another attempt follows (or not this round's)
        if s.meta.get("aborted"):                       # its rank ended it (--colocate's SLEEP): run it again
            await self.ctrl.buffer.put_tasks([r["tasks"][s.task_id]])
            return True
        (r["greedy"] if s.task_id.endswith(".greedy") else r["sampled"]).append(0.0 if s.failed else s.reward)
        if not s.failed:
            r["samples"].append(s)
        r["left"] -= 1
        return True

    def result(self) -> dict:
        """The finished round's accuracy, once; {} while none has finished."""
        r = self.round
        if r is None or r["left"] > 0:
            return {}
        self.round = None
        return {"eval_version": r["version"], "eval_greedy": sum(r["greedy"]) / max(len(r["greedy"]), 1),
                f"eval_mean_at_{r['k']}": sum(r["sampled"]) / max(len(r["sampled"]), 1),
                **{k: v for f in ROUND_METRICS for k, v in f(r["samples"]).items()}}

    async def finish(self) -> dict:
        """Wait for the running round (training samples meanwhile are left unconsumed)."""
        ctrl = self.ctrl
        while self.round is not None and self.round["left"] > 0:
            s = await ctrl.buffer.get_sample(timeout=ctrl.cfg.timeout_s)
            ctrl.received(s)
            if not await self.tap(s):
                ctrl.samples_unconsumed += 1
        return self.result()


def eval_line(e: dict) -> str:
    return f"evaluation of version {e['eval_version']}: " + ", ".join(
        f"{k.removeprefix('eval_').replace('_at_', '@')} {v:.3f}" for k, v in e.items()
        if k != "eval_version")


@extension
class Eval(Extension):
    name, Config = "eval", EvalConfig

    def __init__(self, cfg, part):
        super().__init__(cfg, part)
        self.ev: Evaluation | None = None
        self.held: list = []                            # the held-out problems (trainer rank 0)
        self.firsts, self.lasts = {}, {}                # eval key -> (step, value), for the summary

    @classmethod
    def wanted(cls, part) -> bool:
        return part.eval_every > 0

    def held_out(self, problems, seed: int):
        """(training problems, held-out problems): another extension's (HELD_OUT); else --eval-data; else
        the last --eval-prompts rows of --data (kept out of training); else generated ones from a seed
        training never uses."""
        n, p, task = self.part.eval_prompts, self.part, self.cfg.ext["verifiers"].task
        if own := next((h for f in HELD_OUT if (h := f(self.cfg, seed, n)) is not None), None):
            self.held = own
        elif p.eval_data:
            self.held = load_dataset(p.eval_data, self.cfg.data.prompt_key, self.cfg.data.answer_key)[:n]
        elif problems is not None:
            if len(problems) <= n:
                raise ValueError(f"--eval-every: --data has {len(problems)} rows, too few to hold out "
                                 f"--eval-prompts {n}; pass --eval-data")
            problems, self.held = problems[:-n], problems[-n:]
        elif task:
            make = reasoning_gym_maker(task, seed + 1_000_003)
            self.held = [make(random.Random(i)) for i in range(n)]
        else:
            self.held = make_problems(n, seed=seed + 1_000_003)
        return problems, self.held

    def on_controller(self, ctrl, state):
        self.ev = Evaluation(ctrl)

    async def after_step(self, ctrl, step: int, final: bool):
        """A round that finished meanwhile; at the end, the final weights, always (a round still in flight
        first); else a new round every --eval-every versions."""
        evaluation = self.ev.result()
        if final:
            if earlier := evaluation or await self.ev.finish():
                print0(eval_line(earlier))
            await self.ev.start(self.held, self.part.eval_k)
            evaluation = await self.ev.finish()
        elif ctrl.version % self.part.eval_every == 0:
            await self.ev.start(self.held, self.part.eval_k)
        return evaluation

    def step_line(self, row: dict):
        # (the accuracy: ROUND_METRICS' keys are their extensions' to show)
        got = [f"{k.removeprefix('eval_').replace('_at_', '@')} {v:.3f}" for k, v in row.items()
               if (k == "eval_greedy" or k.startswith("eval_mean_at_")) and v is not None]
        return " | ".join(got) or None

    def on_row(self, row: dict):
        for k, v in row.items():                        # (eval_version too, as every eval_ key)
            if k.startswith("eval_") and v is not None:
                self.firsts.setdefault(k, (row["step"], v))
                self.lasts[k] = (row["step"], v)

    def summary_lines(self, runlog):
        return [f"  {k:<10} {v0:.3f} (step {s0}) -> {self.lasts[k][1]:.3f} (step {self.lasts[k][0]})"
                for k, (s0, v0) in sorted(self.firsts.items())]
