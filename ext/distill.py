"""ext/distill.py: on-policy distillation. A teacher model, served by engines of its own, scores every sampled
response token by token, and the student learns the per-token reverse KL to it, asynchronously.

    bash run.sh --teacher .cache/tiny-teacher --teacher-gpus 1 --distill-coef 1      # RL + distillation
    bash run.sh --teacher .cache/tiny-teacher --teacher-gpus 1 --distill-coef 1 --reward none \
        --no-filter-groups                                                            # distillation alone
    python -m ext.distill --build                                                     # build the tiny teacher
    python -m ext.distill --build --near         # a teacher within reach: the student + 500 supervised steps

The objective (Agarwal et al. 2023, GKD; Thinking Machines' "On-Policy Distillation", 2025): per model token,

    A_t = A_reward + --distill-coef x clip(log pi_teacher(x_t) - log mu(x_t), -c, c),   c = --distill-clip

with mu the behaviour log-prob the engine reported and pi_teacher the teacher's, both of softmax(logits / T)
at the student's --temperature T, trained with the run's --loss and its importance weights (an advantage
shaper, losses.ADV_SHAPERS: every loss gets per-token advantages). The gap is the negative per-token reverse
KL of the sample.

What --distill-coef weighs against. Distillation alone (--reward none, --no-filter-groups): A_reward is 0, the
gap is not clipped (auto), and the coefficient scales the step as a learning rate would. With a reward (a
verifier's or a judge's): A_reward is the group-normalised advantage, about +-1 a sample and the same on each
of its tokens, while a token the teacher rules out has a gap of 15-26 nats (a wrong digit of the embedded
task; results/README.md): unclipped, the teacher's term decides the sign of nearly every such token and the
reward barely counts. So with a reward the gap is clipped at 1 nat by default (--distill-clip -1, auto), the
scale of the reward's advantage: the teacher's term on a token is then at most --distill-coef, and the
coefficient is the teacher's weight against the reward's, token for token (at 0.5 a right answer keeps half
its advantage on a token the teacher rules out; at 1 the two cancel there; 0 < gap: the teacher adds up to
coef where it likes the token more than the student did).

The teacher's log-probs at T: a served rank's engine reports a prompt's log-probs from the raw logits
(temperature 1: vLLM applies no temperature to a prompt). At T != 1 the request asks for every token's
log-prob at each position and takes log_softmax(logp / T) (exact: logp differs from logits by a constant a
position); that costs the served rank a vocabulary's worth of values per scored token: nothing for the
embedded model's 64, heavy for a real model's ~150k (vllm_engine.VLLMEngine.score).

Where the teacher runs: --teacher-gpus K more ranks of the same torchrun job, after the rollout ranks, each
with a vLLM engine of the teacher (it never takes a weight sync): served ranks (ext/served.py, which says how
rollout ranks reach them and what a dead one costs). As a trajectory finishes on a rollout rank (the sample
finisher, beside its other trajectories' generation, as a slow reward is), its tokens go to them for their
prompt log-probs of the whole sequence; the teacher's log-probs of the model tokens ride in the sample's
token_fields["teacher_logp"] to the trainer. A sample whose answer does not come within --teacher-timeout-s
fails (counted, tried again with a new trajectory, as an env failure); a sample longer than the teacher's
context fails the same way, named. At start-up (rank 0) a teacher whose context cannot hold the longest
request is refused by name: the longest prompt (every --data row, else 1,000 drawn problems) plus
--max-tokens; under a multi-turn --env, the student's whole context (a trajectory may fill it).

Recorded per step: teacher_kl (mean per-token reverse KL, log mu - log pi_teacher, over the trained samples'
model tokens) and time_teacher (mean seconds a trained sample waited for its teacher's answer). teacher_kl
moves with each step's mix of easy and hard problems (0.4 nats step to step on the embedded task), so with
--eval-every the teacher also scores each evaluation round's held-out samples (ext/eval.py: the same problems
every round; the k samples at temperature 1, not the greedy one), at temperature 1 as they were sampled:
eval_teacher_kl, the same mean over them, in the round's row. A held-out sample the teacher cannot score keeps
its reward and is left out of it.

The embedded teacher: `python -m ext.distill --build` builds .cache/tiny-teacher, the tiny model's
architecture and tokenizer (tiny_model.py) warm-started four times as long (run.sh builds it when --teacher
names it).
"""

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from config import Extension, check, extension, opt
from ext.eval import ROUND_METRICS
from ext.served import check_model_dir, client, drawn_problems, run_rank, served_context, stop
from losses import ADV_SHAPERS, loss
from rollout import EnvFailure

NAME = "teacher"      # its served ranks' queues (ext/served.py): "teacher", "teacher<r>", "teacher_ready<r>"
ROOT = Path(__file__).resolve().parent.parent
TEACHER_DIR = ROOT / ".cache" / "tiny-teacher"
AUTO_CLIP = 1.0       # nats: --distill-clip's auto with a reward, the scale of the reward's advantage
EVAL_TEMPERATURE = 1.0    # ext/eval.py's k held-out samples a problem (its greedy one, "*.greedy": unscored)


@dataclass
class DistillConfig:
    teacher: str = opt("", "on-policy distillation: a teacher model dir with the student's tokenizer, "
                           "whose per-token log-probs of every sampled response guide the student "
                           "(--distill-coef); empty = off")
    teacher_gpus: int = opt(0, "ranks after the rollout ranks that serve --teacher (a vLLM engine each)")
    teacher_timeout_s: float = opt(60.0, "a sample waits this long for its teacher's answer, then fails (and "
                                         "is tried again)")

    def __post_init__(self):
        check(self, at_least=dict(teacher_gpus=0), above=dict(teacher_timeout_s=0))
        if bool(self.teacher) != (self.teacher_gpus > 0):
            raise ValueError(f"--teacher {self.teacher or '(none)'} and --teacher-gpus {self.teacher_gpus}: "
                             f"a teacher needs ranks to run on, and ranks need a teacher: give both")


@dataclass
class DistillParams:
    distill_coef: float = opt(0.0, "on-policy distillation: A_t = A + this x clip(log pi_teacher - log mu) "
                                   "per model token (--teacher's log-probs); with a reward, the teacher's "
                                   "weight against the reward's advantage (about +-1 a sample) under "
                                   "--distill-clip's auto; 0 = off")
    distill_clip: float = opt(-1.0, "the teacher's per-token gap log pi_teacher - log mu is clipped to "
                                    "+-this many nats before --distill-coef scales it; 0 = never; -1 = auto: "
                                    "1 with a reward (a verifier's or a judge's), never for distillation "
                                    "alone (--reward none)")

    def __post_init__(self):
        check(self, at_least=dict(distill_coef=0, distill_clip=-1))
        if -1 < self.distill_clip < 0:
            raise ValueError(f"--distill-clip must be >= 0, or -1 (auto), got {self.distill_clip}")


@loss(hparams=DistillParams)
def distill(mb, params) -> object:
    """The advantage shaper: per-token advantages [B, T] from the teacher's log-probs (module docstring)."""
    if params is None or not params.distill_coef:
        return mb["adv"]
    adv = mb["adv"][:, None] if mb["adv"].dim() == 1 else mb["adv"]
    gap = (mb["fields"]["teacher_logp"] - mb["old_logp"]) * mb["mask"]       # log pi_teacher - log mu, nats
    if params.distill_clip > 0:
        gap = gap.clamp(-params.distill_clip, params.distill_clip)
    return adv + params.distill_coef * gap


ADV_SHAPERS["distill"] = distill


def resolved_clip(cfg) -> float:
    """--distill-clip settled: its auto is AUTO_CLIP when a reward trains too (a verifier's or a judge's),
    else 0 (never)."""
    clip = cfg.train.hparams["distill"].distill_clip
    if clip != -1:
        return clip
    judge = cfg.ext.get("judge")
    rewarded = cfg.rollout.reward != "none" or bool(judge and judge.judge)
    return AUTO_CLIP if rewarded else 0.0


class TeacherClient:
    """A rollout rank's sample finisher: each finished sample's tokens to the teacher ranks, their log-probs
    of its model tokens (at the sample's temperature) into the sample."""

    def __init__(self, transport, rank: int, timeout_s: float, startup_s: float, num_teachers: int,
                 temperature: float = 1.0):
        self.rank, self.timeout_s, self.temperature = rank, timeout_s, temperature
        self.teachers = client(transport, rank, NAME, num_teachers, startup_s)

    async def __call__(self, s):
        """Score sample s: token_fields["teacher_logp"], one per model token; meta["teacher_s"]. A held-out
        sample (evaluation: never trained) is scored for eval_teacher_kl, and a failure to score it leaves it
        as it was (meta["teacher_error"])."""
        if not s.meta.get("eval"):
            return await self.score(s, self.temperature)
        if s.task_id.endswith(".greedy"):        # (greedy: no distribution of the student's to compare)
            return
        try:
            await self.score(s, EVAL_TEMPERATURE)
        except EnvFailure as e:
            s.meta["teacher_error"] = str(e)

    async def score(self, s, temperature: float):
        t0 = time.monotonic()
        where = f"rollout rank {self.rank}: task {s.task_id}'s teacher scores"
        # [len(ids) - 1]: each token after the first, given the rest, at the temperature (None: 1)
        logprobs = await self.teachers.ask("score", s.prompt_ids + s.response_ids,
                                           None if temperature == 1 else temperature, self.timeout_s, where,
                                           "--teacher-timeout-s")
        answer = logprobs[len(s.prompt_ids) - 1:]                   # the response's tokens
        s.token_fields["teacher_logp"] = [lp for lp, m in zip(answer, s.loss_mask) if m]
        s.meta["teacher_s"] = time.monotonic() - t0


def mean_kl(samples) -> float | None:
    """The mean reverse KL estimate log mu - log pi_teacher over the samples' model tokens the teacher scored
    (None: none)."""
    diffs = [mu - t for s in samples if "teacher_logp" in s.token_fields
             for mu, t in zip((lp for lp, m in zip(s.logprobs, s.loss_mask) if m),
                              s.token_fields["teacher_logp"])]
    return sum(diffs) / len(diffs) if diffs else None


def teacher_kl(batch) -> dict:
    """Over the trained samples' model tokens: the mean reverse KL estimate log mu - log pi_teacher, and the
    mean seconds a sample waited for its teacher."""
    kl, waits = mean_kl(batch), [s.meta["teacher_s"] for s in batch if "teacher_s" in s.meta]
    return {"teacher_kl": kl, "time_teacher": sum(waits) / len(waits)} if kl is not None else {}


def eval_teacher_kl(samples) -> dict:
    """An evaluation round's samples (ext/eval.py's ROUND_METRICS): the mean reverse KL to the teacher over
    the model tokens of those it scored."""
    kl = mean_kl(samples)
    return {} if kl is None else {"eval_teacher_kl": kl}


ROUND_METRICS.append(eval_teacher_kl)


def longest_request(cfg, model_dir: str) -> tuple[int, str]:
    """(tokens, how they add up): the longest sequence the student's samples can send a served model: the
    longest prompt of the problems training draws plus --max-tokens (single-turn), at most the student's
    context; under a multi-turn --env, the student's context."""
    rc = cfg.rollout
    if cfg.controller.env:
        return rc.max_model_len, (f"the student's context (--env {cfg.controller.env}: a trajectory may "
                                  f"fill it)")
    from transformers import AutoTokenizer

    from rollout import PromptFormat
    fmt = PromptFormat(AutoTokenizer.from_pretrained(model_dir), rc.chat_template)
    problems, which = drawn_problems(cfg)
    prompt = max(len(fmt.first(p.prompt)) for p in problems)
    return (min(rc.max_model_len, prompt + rc.max_tokens),
            f"the longest prompt of {which}, {prompt} tokens, + --max-tokens {rc.max_tokens}")


@extension
class Distill(Extension):
    name, Config = "distill", DistillConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return bool(part.teacher)

    @classmethod
    def configure(cls, cfg, part):
        check_model_dir("--teacher", part.teacher, "python -m ext.distill --build"
                        if part.teacher.rstrip("/").endswith("tiny-teacher") else "")
        if cfg.rollout.reward == "none" and cfg.controller.filter_groups:
            raise ValueError("--reward none: every group's rewards are equal, so dynamic filtering would "
                             "drop them all: add --no-filter-groups")
        hp = cfg.train.hparams
        hp["distill"] = dataclasses.replace(hp["distill"], distill_clip=resolved_clip(cfg))   # (its auto)

    def extra_ranks(self) -> int:
        return self.part.teacher_gpus

    def run_extra_rank(self, index: int, device: str, engine_core: str, buffer_addr: tuple, state):
        run_rank(self.cfg, self.part.teacher, NAME, index, device, engine_core, buffer_addr)

    def startup_lines(self, model_dir: str, device: str):
        """(rank 0) The teacher must read the student's tokens as the student does, and hold the longest
        sequence the student can send it."""
        from transformers import AutoTokenizer
        teacher = self.part.teacher
        student, theirs = (AutoTokenizer.from_pretrained(d).get_vocab() for d in (model_dir, teacher))
        if student != theirs:
            raise SystemExit(f"--teacher {teacher}: its vocabulary ({len(theirs)} tokens) is not the "
                             f"student's ({model_dir}, {len(student)} tokens): a teacher must share the "
                             f"student's tokenizer")
        context = served_context(teacher)
        if context < self.cfg.rollout.max_model_len:     # (else it holds whatever the student's context does)
            longest, what = longest_request(self.cfg, model_dir)
            if longest > context:
                raise SystemExit(
                    f"--teacher {teacher}: its context ({context} tokens) cannot hold the longest sequence "
                    f"the student can send it, {longest} tokens ({what}): every such sample would fail; "
                    f"lower --max-tokens, or cap the student's trajectories with --max-model-len {context}")
        hp, t = self.cfg.train.hparams["distill"], self.cfg.rollout.temperature
        return (f"teacher: {teacher} on {self.part.teacher_gpus} rank(s), context {context}, --distill-coef "
                f"{hp.distill_coef}, " + (f"the gap clipped at +-{hp.distill_clip:g} nats" if hp.distill_clip
                                          else "the gap unclipped")
                + (f", scored at temperature {t:g} (every token's log-prob)" if t != 1 else ""))

    def sample_finisher(self, index: int, buffer):
        return TeacherClient(buffer.transport, index, self.part.teacher_timeout_s,
                             self.cfg.controller.startup_timeout_s, self.part.teacher_gpus,
                             self.cfg.rollout.temperature)

    def on_controller(self, ctrl, state):
        self.ctrl = ctrl

    async def after_step(self, ctrl, step: int, final: bool) -> dict:
        return teacher_kl(ctrl.batch)

    def step_line(self, row: dict) -> str | None:
        got = [f"{name} {row[k]:.3f}" for k, name in (("teacher_kl", "teacher_kl"),
                                                      ("eval_teacher_kl", "held-out teacher_kl")) if k in row]
        return " ".join(got) or None

    def on_finish(self):
        stop(self.ctrl, NAME, self.part.teacher_gpus)


# ---------------------------------------------------------------------------------------------
# the embedded teacher


def ensure_tiny_teacher(log=print, force: bool = False) -> Path:
    """Build (or reuse) .cache/tiny-teacher: the embedded student's architecture and tokenizer, another seed,
    warm-started four times as long (4,000 steps), so it starts where RL on the default model would like to
    end (its build.json: its accuracy)."""
    import tiny_model
    return tiny_model.ensure_tiny_model(TEACHER_DIR, tiny_model.TinyConfig(seed=1, sft_steps=4000),
                                        force=force, log=log)


def ensure_near_teacher(log=print, force: bool = False) -> Path:
    """Build (or reuse) .cache/tiny-teacher-near: a teacher within the student's reach, the embedded student
    (.cache/tiny-qwen2) plus 500 supervised steps on another seed's problems (results/README.md, "On-policy
    distillation": how fast the student matches a teacher this close)."""
    import tiny_model
    student = tiny_model.ensure_tiny_model(log=log)
    return tiny_model.ensure_tiny_model(student.parent / "tiny-teacher-near",
                                        tiny_model.TinyConfig(seed=3, sft_steps=500, init_from=student.name),
                                        force=force, log=log)


if __name__ == "__main__":
    import argparse
    import json
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="build (or reuse) .cache/tiny-teacher")
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    ap.add_argument("--near", action="store_true",
                    help="with --build: .cache/tiny-teacher-near (the student plus 500 supervised steps)")
    ap.add_argument("--quiet", action="store_true", help="print nothing when the cached teacher is reused")
    args = ap.parse_args()
    if args.build:                                               # (a build logs its progress either way)
        path = (ensure_near_teacher if args.near else ensure_tiny_teacher)(force=args.force)
        if not args.quiet:
            print(json.dumps(json.loads((path / "build.json").read_text()), indent=2))
