"""ext/distill.py: on-policy distillation. A teacher model, served by engines of its own, scores every sampled
response token by token, and the student learns the per-token reverse KL to it, asynchronously.

    bash run.sh --teacher .cache/tiny-teacher --teacher-gpus 1 --distill-coef 1      # RL + distillation
    bash run.sh --teacher .cache/tiny-teacher --teacher-gpus 1 --distill-coef 1 --reward none \
        --no-filter-groups                                                            # distillation alone

The objective (Agarwal et al. 2023, GKD; Thinking Machines' "On-Policy Distillation", 2025): per model token,

    A_t = A_reward + --distill-coef x (log pi_teacher(x_t) - log mu(x_t))

with mu the behaviour log-prob the engine reported, trained with the run's --loss and its importance weights
(an advantage shaper, losses.ADV_SHAPERS: every loss gets per-token advantages). The second term is the
negative per-token reverse KL of the sample; --reward none (no verifier) and --no-filter-groups make it pure
distillation, both together mix it with RL.

Where the teacher runs: --teacher-gpus K more ranks of the same torchrun job, after the rollout ranks, each
with a vLLM engine of the teacher (it never takes a weight sync): served ranks (ext/served.py, which says how
rollout ranks reach them and what a dead one costs). As a trajectory finishes on a rollout rank (the sample
finisher, beside its other trajectories' generation, as a slow reward is), its tokens go to them for their
prompt log-probs of the whole sequence; the teacher's log-probs of the model tokens ride in the sample's
token_fields["teacher_logp"] to the trainer. A sample whose answer does not come within --teacher-timeout-s
fails (counted, tried again with a new trajectory, as an env failure); a sample longer than the teacher's
context fails the same way, named.

Recorded per step: teacher_kl (mean per-token reverse KL, log mu - log pi_teacher, over the trained samples'
model tokens) and time_teacher (mean seconds a trained sample waited for its teacher's answer).

The embedded teacher: `python tiny_model.py --teacher` builds .cache/tiny-teacher, the tiny model's
architecture and tokenizer warm-started four times as long (run.sh builds it when --teacher names it).
"""

import time
from dataclasses import dataclass

from config import Extension, check, extension, opt
from ext.served import check_model_dir, client, run_rank, stop
from losses import ADV_SHAPERS, loss

NAME = "teacher"      # its served ranks' queues (ext/served.py): "teacher", "teacher<r>", "teacher_ready<r>"


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
    distill_coef: float = opt(0.0, "on-policy distillation: A_t = A + this x (log pi_teacher - log mu) per "
                                   "model token (--teacher's log-probs); 0 = off")

    def __post_init__(self):
        check(self, at_least=dict(distill_coef=0))


@loss(hparams=DistillParams)
def distill(mb, params) -> object:
    """The advantage shaper: per-token advantages [B, T] from the teacher's log-probs (module docstring)."""
    if params is None or not params.distill_coef:
        return mb["adv"]
    adv = mb["adv"][:, None] if mb["adv"].dim() == 1 else mb["adv"]
    gap = (mb["fields"]["teacher_logp"] - mb["old_logp"]) * mb["mask"]       # log pi_teacher - log mu
    return adv + params.distill_coef * gap


ADV_SHAPERS["distill"] = distill


class TeacherClient:
    """A rollout rank's sample finisher: each finished sample's tokens to the teacher ranks, their log-probs
    of its model tokens into the sample."""

    def __init__(self, transport, rank: int, timeout_s: float, startup_s: float, num_teachers: int):
        self.rank, self.timeout_s = rank, timeout_s
        self.teachers = client(transport, rank, NAME, num_teachers, startup_s)

    async def __call__(self, s):
        """Score sample s: token_fields["teacher_logp"], one per model token; meta["teacher_s"]."""
        if s.meta.get("eval"):                  # (evaluation is never trained)
            return
        t0 = time.monotonic()
        where = f"rollout rank {self.rank}: task {s.task_id}'s teacher scores"
        # [len(ids) - 1]: each token after the first, given the rest
        logprobs = await self.teachers.ask("score", s.prompt_ids + s.response_ids, None, self.timeout_s,
                                           where, "--teacher-timeout-s")
        answer = logprobs[len(s.prompt_ids) - 1:]                   # the response's tokens
        s.token_fields["teacher_logp"] = [lp for lp, m in zip(answer, s.loss_mask) if m]
        s.meta["teacher_s"] = time.monotonic() - t0


def teacher_kl(batch) -> dict:
    """Over the trained samples' model tokens: the mean reverse KL estimate log mu - log pi_teacher, and the
    mean seconds a sample waited for its teacher."""
    diffs = [mu - t for s in batch if "teacher_logp" in s.token_fields
             for mu, t in zip((lp for lp, m in zip(s.logprobs, s.loss_mask) if m),
                              s.token_fields["teacher_logp"])]
    waits = [s.meta["teacher_s"] for s in batch if "teacher_s" in s.meta]
    return {"teacher_kl": sum(diffs) / len(diffs), "time_teacher": sum(waits) / len(waits)} if diffs else {}


@extension
class Distill(Extension):
    name, Config = "distill", DistillConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return bool(part.teacher)

    @classmethod
    def configure(cls, cfg, part):
        check_model_dir("--teacher", part.teacher, "python tiny_model.py --teacher"
                        if part.teacher.rstrip("/").endswith("tiny-teacher") else "")
        if cfg.rollout.reward == "none" and cfg.controller.filter_groups:
            raise ValueError("--reward none: every group's rewards are equal, so dynamic filtering would "
                             "drop them all: add --no-filter-groups")

    def extra_ranks(self) -> int:
        return self.part.teacher_gpus

    def run_extra_rank(self, index: int, device: str, engine_core: str, buffer_addr: tuple, state):
        run_rank(self.cfg, self.part.teacher, NAME, index, device, engine_core, buffer_addr)

    def startup_lines(self, model_dir: str, device: str):
        """(rank 0) The teacher must read the student's tokens as the student does."""
        from transformers import AutoTokenizer
        student, teacher = (AutoTokenizer.from_pretrained(d).get_vocab()
                            for d in (model_dir, self.part.teacher))
        if student != teacher:
            raise SystemExit(f"--teacher {self.part.teacher}: its vocabulary ({len(teacher)} tokens) is not "
                             f"the student's ({model_dir}, {len(student)} tokens): a teacher must share the "
                             f"student's tokenizer")
        return (f"teacher: {self.part.teacher} on {self.part.teacher_gpus} rank(s), --distill-coef "
                f"{self.cfg.train.hparams['distill'].distill_coef}")

    def sample_finisher(self, index: int, buffer):
        return TeacherClient(buffer.transport, index, self.part.teacher_timeout_s,
                             self.cfg.controller.startup_timeout_s, self.part.teacher_gpus)

    def on_controller(self, ctrl, state):
        self.ctrl = ctrl

    async def after_step(self, ctrl, step: int, final: bool) -> dict:
        return teacher_kl(ctrl.batch)

    def step_line(self, row: dict) -> str | None:
        return f"teacher_kl {row['teacher_kl']:.3f}" if "teacher_kl" in row else None

    def on_finish(self):
        stop(self.ctrl, NAME, self.part.teacher_gpus)

