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
with a vLLM engine of the teacher (it never takes a weight sync). As a trajectory finishes on a rollout rank
(the sample finisher, beside its other trajectories' generation, as a slow reward is), its tokens go on the
queue server's "teacher" queue; an idle teacher rank takes them, asks its engine for the prompt log-probs of
the whole sequence (vLLM's prompt_logprobs, temperature 1) and answers on the rank's own "teacher<r>" queue.
A shared queue that idle teachers pull from balances the load by itself (least loaded, no assignment to
keep); the teacher's log-probs of the model tokens ride in the sample's token_fields["teacher_logp"] to the
trainer. A sample whose answer does not come within --teacher-timeout-s fails (counted, tried again with a
new trajectory, as an env failure): a teacher rank that died or hangs costs those samples and a bounded wait,
never the run; a sample longer than the teacher's context fails the same way, named.

Recorded per step: teacher_kl (mean per-token reverse KL, log mu - log pi_teacher, over the trained samples'
model tokens) and time_teacher (mean seconds a trained sample waited for its teacher's answer).

The embedded teacher: `python tiny_model.py --teacher` builds .cache/tiny-teacher, the tiny model's
architecture and tokenizer warm-started four times as long (run.sh builds it when --teacher names it).
"""

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from config import Extension, check, extension, opt
from losses import ADV_SHAPERS, loss
from rollout import EnvFailure

READY = "teacher_ready"      # + a rollout rank: each teacher rank announces itself there: (index, context)
REQUESTS = "teacher"         # (rollout rank, request id, token ids); None: stop
POLL_S = (0.002, 0.008)      # an empty queue is polled after 2 ms, then ever less often, up to 8 ms


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


async def _call(transport, fn, *args):
    """A named queue's call: off the loop where it is a round trip to the queue server."""
    return await asyncio.to_thread(fn, *args) if transport.round_trips else fn(*args)


class TeacherClient:
    """A rollout rank's side (its sample finisher): each finished sample's tokens to the teacher ranks, the
    answer into the sample. One task per rank (the pump) sends the requests and reads the answers, a list of
    each per round trip, and wakes the samples waiting for them."""

    def __init__(self, transport, rank: int, timeout_s: float, startup_s: float, num_teachers: int):
        self.transport, self.rank = transport, rank
        self.timeout_s, self.startup_s, self.num_teachers = timeout_s, startup_s, num_teachers
        self.requests, self.replies = transport.named(REQUESTS), transport.named(f"teacher{rank}")
        self.waiting: dict[str, asyncio.Future] = {}
        self.outbox: list = []                   # requests not sent yet
        self.pump: asyncio.Task | None = None
        self.context = 0                    # the teachers' context (tokens), once they are up
        self.up: asyncio.Task | None = None     # waiting for them
        self.sent = 0

    async def _ready(self):
        """Wait for every teacher rank's engine (its start takes as long as a rollout rank's): each announces
        itself and its context on every rollout rank's ready queue."""
        ready, got = self.transport.named(f"{READY}{self.rank}"), []
        deadline = time.monotonic() + self.startup_s
        while len(got) < self.num_teachers:
            got += await _call(self.transport, ready.get_many, self.num_teachers)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout rank {self.rank}: {len(got)} of {self.num_teachers} teacher "
                                   f"ranks up within {self.startup_s:.0f}s (--startup-timeout-s)")
            await asyncio.sleep(0 if len(got) == self.num_teachers else 0.5)
        self.context = min(c for _, c in got)

    async def _pump(self):
        """Each tick, two round trips at most: the requests made since the last one go out together, the
        answers that came in wake their samples."""
        wait = POLL_S[0]
        while True:
            if self.outbox:
                out, self.outbox = self.outbox, []
                await _call(self.transport, self.requests.put_many, out)
            got = await _call(self.transport, self.replies.get_many, 1024)
            for rid, logprobs in got:
                fut = self.waiting.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(logprobs)
            wait = POLL_S[0] if got or self.outbox else min(2 * wait, POLL_S[1])
            await asyncio.sleep(0 if got else wait)

    async def __call__(self, s):
        """Score sample s: token_fields["teacher_logp"], one per model token; meta["teacher_s"]."""
        if s.meta.get("eval"):                  # (evaluation is never trained)
            return
        if self.up is None:             # (the first sample waits for the teachers; the others wait with it)
            self.up = asyncio.get_running_loop().create_task(self._ready())
        await asyncio.shield(self.up)
        if self.pump is None or self.pump.done():
            self.pump = asyncio.get_running_loop().create_task(self._pump())
        ids = s.prompt_ids + s.response_ids
        where = f"rollout rank {self.rank}: task {s.task_id}'s teacher scores"
        if len(ids) > self.context:
            raise EnvFailure(f"{where}: the sample's {len(ids)} tokens exceed the teacher's context "
                             f"({self.context})")
        self.sent += 1
        rid, t0 = f"{self.rank}.{self.sent}", time.monotonic()
        fut = self.waiting[rid] = asyncio.get_running_loop().create_future()
        self.outbox.append((self.rank, rid, ids))        # (the pump sends it with the others)
        try:
            async with asyncio.timeout(self.timeout_s):
                logprobs = await fut            # [len(ids) - 1]: each token after the first, given the rest
        except TimeoutError:
            raise EnvFailure(f"{where}: no answer within {self.timeout_s:.0f}s (--teacher-timeout-s): "
                             f"a teacher rank dead or overloaded?", timeout=True) from None
        finally:
            self.waiting.pop(rid, None)
        if isinstance(logprobs, str):
            raise EnvFailure(f"{where}: {logprobs}")
        answer = logprobs[len(s.prompt_ids) - 1:]                   # the response's tokens
        s.token_fields["teacher_logp"] = [lp for lp, m in zip(answer, s.loss_mask) if m]
        s.meta["teacher_s"] = time.monotonic() - t0


async def serve_teacher(cfg, part: DistillConfig, index: int, device: str, engine_core: str,
                        buffer_addr: tuple):
    """A teacher rank: its engine up, then every request it takes answered with the engine's prompt log-probs
    (concurrent requests batch in the engine), until a stop."""
    from buffer import ManagerQueues
    from proxy import LLMProxy
    who, rc = f"teacher rank {index}", cfg.rollout
    proxy = await LLMProxy.start_vllm(part.teacher, rank=index, timeout_s=cfg.controller.timeout_s,
                                      startup_timeout_s=cfg.controller.startup_timeout_s,
                                      cpu_cores=engine_core,
                                      max_num_seqs=rc.max_concurrency, dtype=rc.dtype,
                                      enforce_eager=True if device == "cpu" else None,
                                      seed=cfg.train.seed + 1000 + index)
    try:
        queues = await asyncio.to_thread(ManagerQueues.connect, *buffer_addr, cfg.rollout_gpus,
                                         cfg.controller.startup_timeout_s, who)
        context = proxy.engine.llm.model_config.max_model_len
        for r in range(cfg.rollout_gpus):               # (each rollout rank reads its own)
            await asyncio.to_thread(queues.named(f"{READY}{r}").put_many, [(index, context)])
        requests, running = queues.named(REQUESTS), set()
        replies = [queues.named(f"teacher{r}") for r in range(cfg.rollout_gpus)]
        answers: list[list] = [[] for _ in replies]      # per rollout rank, answered and not sent yet

        async def answer(rank: int, rid: str, ids: list[int]):
            try:
                out = await proxy.score(ids)
            except Exception as e:     # (a sample's own failure, named; an engine that died fails them all)
                out = f"{who}: {e!r}"[:500]
            answers[rank].append((rid, out))     # (after the await: the list to send may be a new one now)
        wait = POLL_S[0]
        while True:
            for rank, out in enumerate(answers):          # each tick: every answer so far, a list a rank
                if out:
                    answers[rank] = []
                    await asyncio.to_thread(replies[rank].put_many, out)
            try:
                got = await asyncio.to_thread(requests.get_many, 1024)
            except (EOFError, ConnectionError):      # the queue server is gone: trainer rank 0's run ended
                break                                # (a crash there is named at the final barrier)
            if None in got:            # the run ended (rank 0 puts one stop per teacher rank)
                break
            for rank, rid, ids in got:
                task = asyncio.get_running_loop().create_task(answer(rank, rid, ids))
                running.add(task)
                task.add_done_callback(running.discard)
            wait = POLL_S[0] if got or running else min(2 * wait, POLL_S[1])
            await asyncio.sleep(0 if got else wait)
    finally:
        proxy.shutdown()


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
        if not (Path(part.teacher) / "config.json").exists():
            tiny = Path(part.teacher).name == "tiny-teacher"
            raise ValueError(f"--teacher {part.teacher}: not a Hugging Face model dir (no config.json)"
                             + (" (python tiny_model.py --teacher builds it)" if tiny else ""))
        if cfg.rollout.reward == "none" and cfg.controller.filter_groups:
            raise ValueError("--reward none: every group's rewards are equal, so dynamic filtering would "
                             "drop them all: add --no-filter-groups")

    def extra_ranks(self) -> int:
        return self.part.teacher_gpus

    def run_extra_rank(self, index: int, device: str, engine_core: str, buffer_addr: tuple, state):
        from ranks import pin_engine_gpu
        pin_engine_gpu(device)           # GPU: the teacher's engine sees only this rank's GPU
        asyncio.run(serve_teacher(self.cfg, self.part, index, device, engine_core, buffer_addr))

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
        """The run ended: one stop per teacher rank, on their queue (they then join the final barrier)."""
        stops = self.ctrl.buffer.transport.named(REQUESTS)
        stops.put_many([None] * self.part.teacher_gpus)

