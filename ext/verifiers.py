"""ext/verifiers.py: verifiers in worker processes, under a timeout that really interrupts, and
reasoning-gym's procedural tasks (--task NAME, each with its own verifier).

    pool = RewardPool(workers=1, spec="", timeout_s=10)   # a rollout rank's verifier processes
    r = await pool.score(problem, response)     # 0.0: it outlived its deadline; it raised: RuntimeError

On by default wherever the verifier is not the embedded addition check (--data, --task, --reward:
--reward-workers -1 = 1 process then, 0 for the addition check, which runs inline): a rollout rank's envs
score through the pool (Extension.scorer), so a slow or pathological verifier cannot stall the engine's
event loop or hang the rank. --reward-timeout-factor > 0: RollPacker's adaptive verifier timeout
(ext/deadlines.py's RewardDeadline).
"""

import asyncio
import dataclasses
import multiprocessing
import random
from dataclasses import dataclass

from config import Extension, extension, flag, opt
from ext.deadlines import RewardDeadline
from task import VERIFIERS, Problem, load_reward


# ---------------------------------------------------------------------------------------------
# procedural tasks: reasoning-gym


def reasoning_gym_maker(name: str, seed: int):
    """make(rng) -> Problem for controller.problem_stream: entries of reasoning-gym's task `name`,
    drawn by the stream's rng from a dataset generated with `seed` (a different seed: a held-out set)."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("--task needs reasoning-gym (pip install reasoning-gym)") from e
    try:
        ds = reasoning_gym.create_dataset(name, size=100_000, seed=seed)
    except Exception as e:
        raise ValueError(f"--task {name!r}: not a reasoning-gym task ({e})") from None

    def make(rng: random.Random) -> Problem:
        entry = ds[rng.randrange(len(ds))]
        return Problem(entry["question"], str(entry["answer"]), kind=f"rg:{name}", meta={"entry": entry})
    return make


def reasoning_gym_reward(problem: Problem, response: str) -> float:
    import reasoning_gym
    score = reasoning_gym.get_score_answer_fn(problem.kind[3:])
    return float(score(answer=response, entry=problem.meta["entry"]))


VERIFIERS["rg"] = reasoning_gym_reward


# ---------------------------------------------------------------------------------------------
# verifiers in worker processes, with a timeout that interrupts


READY = 0              # the call id of a worker's first message: started, the verifier loaded
WORKER_START_S = 120.0  # a worker's start-up (a spawned interpreter, the verifier's imports) may take this


def _reward_worker(conn, spec: str):
    fn = load_reward(spec)
    conn.send((READY, None))
    while True:
        call_id, problem, response = conn.recv()
        try:
            out = float(fn(problem, response))
        except Exception as e:          # a verifier that raises fails the sample; say why (short: one write)
            out = RuntimeError(f"{type(e).__name__}: {e}"[:1000])
        conn.send((call_id, out))


class RewardPool:
    """`workers` verifier processes. score() sends one call to an idle worker and waits at most
    its deadline: a worker still busy then is killed (SIGKILL) and replaced, and the call scores 0.0
    (counted in `timeouts`): a pathological input cannot hang the rank. A verifier that raises fails
    the call (RuntimeError, counted in `errors`): its sample fails, as with an inline verifier. The
    deadline is timeout_s, or with timeout_factor > 0 the adaptive one (ext/deadlines.py's
    RewardDeadline: min(max(timeout_min_s, timeout_factor x the slowest correct answer so far),
    timeout_s)). Workers are spawned (not forked: the rollout rank has threads) and end with the pool,
    or with this process.

    A worker is idle only when no answer of it is in flight. Every call carries an id that the
    worker echoes, and answers with another id are dropped. A cancelled call (a stale abort, a
    stop, an engine recovery) leaves its worker to a drain task, which waits for the answer (up to
    the call's deadline) before the worker is idle again, or kills and replaces it (counted in
    `abandoned`). The pipe is watched by the event loop itself (add_reader), not by a thread: the
    answer of a call is never read by a thread that a cancelled call left behind, and scoring
    goes on when the default thread pool is busy. Nothing here blocks the loop: a killed worker
    is reaped by multiprocessing when the next one starts, or at shutdown. A worker's start-up (spawning
    an interpreter, importing the verifier: seconds on a busy machine) is not its first call's time: the
    call's deadline starts once the worker says it is ready (within WORKER_START_S, else an error)."""

    def __init__(self, workers: int, spec: str = "", timeout_s: float = 10.0, timeout_factor: float = 0.0,
                 timeout_min_s: float = 0.0):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"RewardPool: need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.spec, self.timeout_s = spec, timeout_s
        self.deadline = RewardDeadline(timeout_s, timeout_factor, timeout_min_s)
        self.ctx = multiprocessing.get_context("spawn")
        self.idle: asyncio.Queue | None = None      # made on first use, on the caller's event loop
        self.workers = workers
        self.procs = set()                          # every live worker process, idle or busy
        self.started = set()                        # those that said they are ready
        self.drains = set()                         # drain tasks of cancelled calls
        self.next_id = 0
        self.timeouts = self.errors = self.abandoned = 0

    def _start(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_reward_worker, args=(child, self.spec), daemon=True)
        p.start()
        child.close()                               # the worker's end lives in the worker: EOF when it dies
        self.procs.add(p)
        return p, parent

    def _replace(self, worker):
        proc, conn = worker
        proc.kill()
        conn.close()
        self.procs.discard(proc)
        self.started.discard(proc)
        self.idle.put_nowait(self._start())

    async def _ready(self, worker):
        """Wait until a new worker has started (its READY message); a worker that dies or outlasts
        WORKER_START_S starting is replaced and the call fails, naming the verifier."""
        proc, conn = worker
        if proc in self.started:
            return
        try:
            await self._answer(conn, READY, asyncio.get_running_loop().time() + WORKER_START_S)
        except asyncio.CancelledError:
            self.idle.put_nowait(worker)            # (still starting: the next call waits for it)
            raise
        except (asyncio.TimeoutError, EOFError, OSError):
            self._replace(worker)
            raise RuntimeError(f"a verifier worker ({self.spec or 'the task verifier'}) died or did not "
                               f"start within {WORKER_START_S:.0f}s") from None
        self.started.add(proc)

    async def _answer(self, conn, call_id: int, deadline: float):
        """The answer to call_id, read when the pipe is readable (an answer is one small write).
        Raises TimeoutError at the deadline, EOFError/OSError if the worker died."""
        loop = asyncio.get_running_loop()
        while True:
            if not conn.poll(0):
                ready = loop.create_future()
                loop.add_reader(conn.fileno(), lambda: ready.done() or ready.set_result(None))
                try:
                    async with asyncio.timeout_at(deadline):
                        await ready
                finally:
                    loop.remove_reader(conn.fileno())
            got_id, out = conn.recv()
            if got_id == call_id:
                return out                          # (an older id: a cancelled call's answer, dropped)

    async def _drain(self, worker, call_id: int, deadline: float):
        try:
            await self._answer(worker[1], call_id, deadline)
            self.idle.put_nowait(worker)
        except (asyncio.TimeoutError, EOFError, OSError):
            self.abandoned += 1
            self._replace(worker)

    async def score(self, problem: Problem, response: str) -> float:
        if self.idle is None:
            self.idle = asyncio.Queue()
            for _ in range(self.workers):
                self.idle.put_nowait(self._start())
        worker = await self.idle.get()
        await self._ready(worker)
        self.next_id += 1
        t0 = asyncio.get_running_loop().time()
        call_id, deadline = self.next_id, t0 + self.deadline.current_s
        try:
            worker[1].send((call_id, problem, response))
            out = await self._answer(worker[1], call_id, deadline)
        except asyncio.CancelledError:              # the answer is still coming: the worker is not idle yet
            drain = asyncio.create_task(self._drain(worker, call_id, deadline))
            self.drains.add(drain)
            drain.add_done_callback(self.drains.discard)
            raise
        except (asyncio.TimeoutError, EOFError, OSError):
            self.timeouts += 1                      # stuck (or died): replace it
            self._replace(worker)
            return 0.0
        self.idle.put_nowait(worker)
        if isinstance(out, Exception):    # (a bug, not a wrong answer: the sample fails, as inline)
            self.errors += 1
            raise RuntimeError(f"the verifier {self.spec or '(the task verifier)'} raised {out}")
        self.deadline.record(asyncio.get_running_loop().time() - t0, out)
        return out

    def shutdown(self):
        for drain in list(self.drains):
            drain.cancel()
        for proc in self.procs:
            proc.kill()
        self.procs.clear()
        self.started.clear()

    def stats(self) -> dict:
        """For the acks: calls that scored 0 for the timeout, and the deadline now."""
        return {"reward_timeouts": self.timeouts, "reward_deadline_s": self.deadline.current_s}


@dataclass
class VerifierConfig:
    task: str = opt("", "a reasoning-gym task (e.g. basic_arithmetic), its own verifier; empty with no "
                        "--data = the embedded addition task")
    reward_workers: int = opt(-1, "verifier processes per rollout rank; 0 = on its event loop; -1 = 0 for "
                                  "the embedded addition check, else 1")
    reward_timeout_s: float = opt(10.0, "a verifier call slower than this scores 0 (its process is "
                                        "replaced); with --reward-timeout-factor > 0: the adaptive timeout's "
                                        "ceiling")
    reward_timeout_factor: float = opt(0.0, "adaptive verifier timeout (RollPacker): a call gets min(max("
                                            "--reward-timeout-min-s, this x the slowest correct answer so "
                                            "far), --reward-timeout-s), then scores 0; 0 = off (needs "
                                            "--reward-workers >= 1)")
    reward_timeout_min_s: float = opt(1.0, "adaptive verifier timeout: never under this, seconds")

    def __post_init__(self):
        if self.reward_workers < -1:
            raise ValueError(f"--reward-workers must be >= -1 (-1 = auto), got {self.reward_workers}")
        for name in ("reward_timeout_s", "reward_timeout_min_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        if self.reward_timeout_factor < 0:
            raise ValueError(f"--reward-timeout-factor must be >= 0 (0 = a fixed --reward-timeout-s), got "
                             f"{self.reward_timeout_factor}")


@extension
class Verifiers(Extension):
    name, Config = "verifiers", VerifierConfig

    @classmethod
    def configure(cls, cfg, part):
        if cfg.data.data and part.task:
            raise ValueError("--data and --task: pick one source of problems")

    def resolve(self, cfg):
        """--reward-workers -1: one process unless the verifier is the embedded addition check, or a judge
        scores (ext/judge.py: its scorer calls the verifier itself, and two scorers cannot both answer)."""
        if self.part.reward_workers >= 0:
            return cfg
        custom = bool(cfg.data.data or self.part.task or cfg.rollout.reward not in ("", "none"))
        judged = bool(getattr(cfg.ext.get("judge"), "judge", ""))
        self.part = dataclasses.replace(self.part, reward_workers=1 if custom and not judged else 0)
        return dataclasses.replace(cfg, ext={**cfg.ext, self.name: self.part})

    def problem_maker(self, seed: int):
        return reasoning_gym_maker(self.part.task, seed) if self.part.task else None

    def scorer(self, index: int, buffer):
        p = self.part
        if p.reward_workers <= 0:
            return None
        return RewardPool(p.reward_workers, self.cfg.rollout.reward, p.reward_timeout_s,
                          p.reward_timeout_factor, p.reward_timeout_min_s)
