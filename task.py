"""task.py: the default task, the reward checkers and the dataset reader.

Owns the embedded default task, procedurally generated integer addition for the tiny
character-level model (tiny_model.py); difficulty is the digits per operand (drawn from `digits`):

    problems = make_problems(n, seed, digits=(1, 2, 3))
    # prompt "37+485="        answer "522"        response "522<eos>"
    reward(problem, response)   # 1.0 for an exact answer, else 0.0: the paper's RLVR setting

Real models pass `--data PATH` (JSONL or parquet rows, scored with math-verify), `--task NAME` (a
reasoning-gym task and its verifier) or `--reward module:function`, `function(problem: Problem,
response: str) -> float in [0, 1]`. Verifiers run in RewardPool's worker processes under a timeout
that really interrupts; the addition check runs inline.

Deviations from the paper: the default task is a toy sized for the tiny model; per-problem
`target_len` (benchmarks) asks for exactly that many tokens (ignore_eos), for long-tailed lengths.

Design notes: DESIGN.md#taskpy
"""

import asyncio
import functools
import importlib
import json
import math
import multiprocessing
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from config import opt
from deadline import RewardDeadline


@dataclass
class Problem:
    prompt: str             # text given to the model
    answer: str             # reference answer the verifier checks against
    kind: str = "add"       # "add": the default task; "math": --data rows; "rg:NAME": a reasoning-gym task
    target_len: int = 0     # >0: benchmark mode, generate exactly this many tokens
    meta: dict = field(default_factory=dict)   # a verifier's extra input (reasoning-gym: the entry)


# ---------------------------------------------------------------------------------------------
# default task: addition


def make_problem(rng: random.Random, digits: tuple[int, ...] = (1, 2, 3)) -> Problem:
    """One addition problem; each operand has a number of digits drawn from `digits`."""
    a = rng.randrange(10 ** (rng.choice(digits)))
    b = rng.randrange(10 ** (rng.choice(digits)))
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b), kind="add")


def make_problems(n: int, seed: int, digits: tuple[int, ...] = (1, 2, 3)) -> list[Problem]:
    rng = random.Random(seed)
    return [make_problem(rng, digits) for _ in range(n)]


def reward_add(response: str, answer: str) -> float:
    """1.0 if the response (up to end of sequence) is exactly the answer, else 0.0."""
    return 1.0 if response.strip() == answer else 0.0


# ---------------------------------------------------------------------------------------------
# real data: JSONL or parquet with math-verify


PROMPT_KEYS = ("prompt", "question", "problem")
ANSWER_KEYS = ("answer", "solution", "ground_truth")


def _pick(row: dict, keys: tuple[str, ...], where: str) -> str:
    for k in keys:
        if k in row and row[k] is not None:
            return str(row[k])
    raise ValueError(f"{where}: row has none of the fields {keys}; fields present: {sorted(row)}")


def load_dataset(path: str, prompt_key: str = "", answer_key: str = "") -> list[Problem]:
    """Read JSONL (.jsonl/.json) or parquet rows with a prompt and an answer field (prompt_key and
    answer_key when given, else the first of PROMPT_KEYS / ANSWER_KEYS present).

    A malformed row raises ValueError naming the file and line (row index for parquet)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--data {path}: no such file")
    rows: list[tuple[str, dict]] = []
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: only needed for parquet input
        except ImportError as e:
            raise ImportError(f"--data {path}: reading parquet needs pyarrow (pip install pyarrow)") from e
        for i, row in enumerate(pq.read_table(p).to_pylist()):
            rows.append((f"{path} row {i}", row))
    else:
        with open(p) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
                rows.append((where, row))
    pk, ak = (prompt_key,) if prompt_key else PROMPT_KEYS, (answer_key,) if answer_key else ANSWER_KEYS
    problems = [Problem(_pick(r, pk, w), _pick(r, ak, w), kind="math") for w, r in rows]
    if not problems:
        raise ValueError(f"--data {path}: no rows")
    return problems


def reward_math(response: str, answer: str) -> float:
    """math-verify: parse the reference and the response, 1.0 if they are equivalent."""
    from math_verify import parse, verify  # lazy: heavy import (sympy), only for --data runs

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    pred = parse(response)
    try:
        return 1.0 if verify(gold, pred) else 0.0
    except Exception:  # a verifier crash on odd model output is a wrong answer, not a dead run
        return 0.0


# ---------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    """Where the problems come from: --data (a dataset), --task (reasoning-gym) or the embedded addition
    task; and the held-out set --eval-every scores."""
    data: str = opt("", "JSONL/parquet with prompt + answer rows, scored by math-verify; empty = see --task")
    prompt_key: str = opt("", "--data: the prompt's field (default: the first of "
                              + ", ".join(PROMPT_KEYS) + ")")
    answer_key: str = opt("", "--data: the answer's field (default: the first of "
                              + ", ".join(ANSWER_KEYS) + ")")
    task: str = opt("", "a reasoning-gym task (e.g. basic_arithmetic), its own verifier; empty with no "
                        "--data = the embedded addition task")
    eval_data: str = opt("", "held-out JSONL/parquet; default: the last --eval-prompts rows of --data, or "
                             "generated problems from a seed training never uses")
    eval_prompts: int = opt(64, "held-out prompts per evaluation")
    eval_k: int = opt(4, "samples per held-out prompt at temperature 1 (mean@k)")
    response_len_median: float = opt(0.0, "a long-tail length workload (benchmarks): each training prompt "
                                          "asks for exactly lognormal(this, --response-len-sigma) response "
                                          "tokens, drawn once per prompt (EOS ignored: the answer is scored "
                                          "up to its first EOS, the tokens after it are generated and "
                                          "trained through but out of the loss); 0 = off")
    response_len_sigma: float = opt(1.0, "--response-len-median's lognormal sigma")

    def __post_init__(self):
        if self.data and self.task:
            raise ValueError("--data and --task: pick one source of problems")
        if self.response_len_median < 0 or self.response_len_sigma < 0:
            raise ValueError(f"--response-len-median and --response-len-sigma must be >= 0, got "
                             f"{self.response_len_median}, {self.response_len_sigma}")
        if self.eval_prompts < 1 or self.eval_k < 1:
            raise ValueError(f"--eval-prompts and --eval-k must be >= 1, got {self.eval_prompts}, "
                             f"{self.eval_k}")

    def sources(self, seed: int, evaluate: bool):
        """(training problems or None, make(rng) -> Problem for generated ones, the held-out problems).
        Held out: --eval-data if given; else the last --eval-prompts rows of --data (kept out of
        training); else generated ones from a seed training never uses."""
        problems = load_dataset(self.data, self.prompt_key, self.answer_key) if self.data else None
        make = reasoning_gym_maker(self.task, seed) if self.task else make_problem
        if self.response_len_median > 0:     # the budget is the prompt's: a deferred prompt keeps its length
            rng = random.Random(seed + 7)
            problems = problems and [replace(p, target_len=self.response_len(rng)) for p in problems]
            make = functools.partial(self._with_length, make)
        n, held_out = self.eval_prompts, []
        if not evaluate:
            return problems, make, held_out
        if self.eval_data:
            held_out = load_dataset(self.eval_data, self.prompt_key, self.answer_key)[:n]
        elif problems is not None:
            if len(problems) <= n:
                raise ValueError(f"--eval-every: --data has {len(problems)} rows, too few to hold out "
                                 f"--eval-prompts {n}; pass --eval-data")
            held_out, problems = problems[-n:], problems[:-n]
        elif self.task:
            make_held_out = reasoning_gym_maker(self.task, seed + 1_000_003)
            held_out = [make_held_out(random.Random(i)) for i in range(n)]
        else:
            held_out = make_problems(n, seed=seed + 1_000_003)
        return problems, make, held_out

    def response_len(self, rng: random.Random) -> int:
        return max(1, round(rng.lognormvariate(math.log(self.response_len_median), self.response_len_sigma)))

    def _with_length(self, make, rng: random.Random) -> Problem:
        return replace(make(rng), target_len=self.response_len(rng))


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


def reward(problem: Problem, response: str) -> float:
    """Verifier reward in [0, 1] for one response text."""
    if problem.kind == "add":
        return reward_add(response, problem.answer)
    if problem.kind.startswith("rg:"):
        import reasoning_gym
        score = reasoning_gym.get_score_answer_fn(problem.kind[3:])
        return float(score(answer=response, entry=problem.meta["entry"]))
    return reward_math(response, problem.answer)


def load_reward(spec: str):
    """--reward: "" -> reward(); "module:function" -> that function (problem, response) -> float."""
    if not spec:
        return reward
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--reward {spec!r}: cannot load it ({e}); expected module:function") from None
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: not a function")
    return fn


# ---------------------------------------------------------------------------------------------
# verifiers in worker processes, with a timeout that interrupts


def _reward_worker(conn, spec: str):
    fn = load_reward(spec)
    while True:
        call_id, problem, response = conn.recv()
        try:
            out = float(fn(problem, response))
        except Exception as e:          # a verifier that raises scores 0; say why (short: one pipe write)
            out = RuntimeError(f"{type(e).__name__}: {e}"[:1000])
        conn.send((call_id, out))


class RewardPool:
    """`workers` verifier processes. score() sends one call to an idle worker and waits at most
    its deadline: a worker still busy then is killed (SIGKILL) and replaced, and the call scores 0.0
    (counted in `timeouts`): a pathological input cannot hang the rank. The deadline is timeout_s, or
    with timeout_factor > 0 the adaptive one (deadline.RewardDeadline: min(max(timeout_min_s,
    timeout_factor x the slowest correct answer so far), timeout_s)). Workers are spawned (not
    forked: the rollout rank has threads) and end with the pool, or with this process.

    A worker is idle only when no answer of it is in flight. Every call carries an id that the
    worker echoes, and answers with another id are dropped. A cancelled call (a stale abort, a
    stop, an engine recovery) leaves its worker to a drain task, which waits for the answer (up to
    the call's deadline) before the worker is idle again, or kills and replaces it (counted in
    `abandoned`). The pipe is watched by the event loop itself (add_reader), not by a thread: the
    answer of a call is never read by a thread that a cancelled call left behind, and scoring
    goes on when the default thread pool is busy. Nothing here blocks the loop: a killed worker
    is reaped by multiprocessing when the next one starts, or at shutdown."""

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
        self.idle.put_nowait(self._start())

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
        if isinstance(out, Exception):
            self.errors += 1
            return 0.0
        self.deadline.record(asyncio.get_running_loop().time() - t0, out)
        return out

    def shutdown(self):
        for drain in list(self.drains):
            drain.cancel()
        for proc in self.procs:
            proc.kill()
        self.procs.clear()
