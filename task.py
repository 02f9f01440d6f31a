"""task.py: the default task, the reward checkers and the dataset reader.

Owns the embedded default task, procedurally generated integer addition for the tiny
character-level model (tiny_model.py); difficulty is the digits per operand (drawn from `digits`):

    problems = make_problems(n, seed, digits=(1, 2, 3))
    # prompt "37+485="        answer "522"        response "522<eos>"
    reward(problem, response)   # 1.0 for an exact answer, else 0.0: the paper's RLVR setting

Real models pass `--data PATH` (JSONL or parquet rows, scored with math-verify) or `--reward
module:function`, `function(problem: Problem, response: str) -> float` (any finite number). A problem's `kind`
names its verifier (VERIFIERS: "add", "math"; ext/verifiers.py adds reasoning-gym's "rg:NAME" tasks and
the worker processes that score with a timeout that really interrupts).

Deviations from the paper: the default task is a toy sized for the tiny model; per-problem
`target_len` (benchmarks, ext/longtail.py) asks for exactly that many tokens (ignore_eos).
"""

import importlib
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from config import opt


@dataclass
class Problem:
    prompt: str             # text given to the model
    answer: str             # reference answer the verifier checks against
    kind: str = "add"       # its verifier (VERIFIERS): "add" (the default task), "math" (--data), "rg:NAME"
    target_len: int = 0     # >0: benchmark mode, generate exactly this many tokens
    env: str = ""           # the env it runs in (rollout.ENVS), if not its task's: ext/domains.py's domains
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


def reward_add(problem: Problem, response: str) -> float:
    """1.0 if the response (up to end of sequence) is exactly the answer, else 0.0."""
    return 1.0 if response.strip() == problem.answer else 0.0


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
    rows: list[tuple[str, dict]] = []            # (where: its file and line or row, the row)
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: only needed for parquet input
        except ImportError as e:
            raise ImportError(f"--data {path}: reading parquet needs pyarrow (pip install pyarrow)") from e
        rows = [(f"{path} row {i}", row) for i, row in enumerate(pq.read_table(p).to_pylist())]
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


def reward_math(problem: Problem, response: str) -> float:
    """math-verify: parse the reference and the response, 1.0 if they are equivalent."""
    from math_verify import parse, verify  # lazy: heavy import (sympy), only for --data runs

    answer = problem.answer
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    pred = parse(response)
    try:
        return 1.0 if verify(gold, pred) else 0.0
    except Exception:  # a verifier crash on odd model output is a wrong answer, not a dead run
        return 0.0


# ---------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    """Where the problems come from: --data (a dataset) or the embedded addition task (ext/verifiers.py:
    --task; ext/eval.py: the held-out set)."""
    data: str = opt("", "JSONL/parquet with prompt + answer rows, scored by math-verify; empty = the "
                        "embedded addition task (or --task)")
    prompt_key: str = opt("", "--data: the prompt's field (default: the first of "
                              + ", ".join(PROMPT_KEYS) + ")")
    answer_key: str = opt("", "--data: the answer's field (default: the first of "
                              + ", ".join(ANSWER_KEYS) + ")")

    def check(self):
        """Before anything starts: --data reads (a bad row is named with its file and line); exits if not."""
        if self.data:
            try:
                load_dataset(self.data, self.prompt_key, self.answer_key)
            except (OSError, ValueError, ImportError) as e:
                raise SystemExit(f"train.py: {e}" if str(e).startswith("--data")
                                 else f"train.py: --data {self.data}: {e}") from None

    def sources(self, seed: int, exts) -> tuple:
        """(training problems from the dataset, or None; make(rng) -> Problem for generated ones; held-out
        problems): --data, else the default task, then what the run's extensions (config.Extensions) say: a
        task's own generator (--task), a workload's lengths, a held-out split (--eval-every)."""
        problems = load_dataset(self.data, self.prompt_key, self.answer_key) if self.data else None
        make = exts.first("problem_maker", seed) or make_problem
        problems, make = exts.fold("problem_source", (problems, make), seed)
        problems, held_out = exts.first("held_out", problems, seed) or (problems, [])
        return problems, make, held_out


VERIFIERS = {"add": reward_add, "math": reward_math}


def reward(problem: Problem, response: str) -> float:
    """Verifier reward in [0, 1] for one response text, by the problem's kind ("rg:NAME" -> "rg"; unknown:
    math-verify)."""
    return float(VERIFIERS.get(problem.kind.split(":")[0], VERIFIERS["math"])(problem, response))


def load_reward(spec: str):
    """--reward: "" -> reward(); "none" -> no verifier (every answer 0: a reward of the extensions' alone,
    a teacher's); "module:function" -> that function (problem, response) -> float."""
    if not spec:
        return reward
    if spec == "none":
        return lambda problem, response: 0.0
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--reward {spec!r}: cannot load it ({e}); expected module:function") from None
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: not a function")
    return fn


def problem_stream(problems: list[Problem] | None, seed: int, start: int = 0, make=None):
    """Endless problems: a shuffled pass over a dataset, or generated ones; skips `start` (resume)."""
    rng = random.Random(seed)

    def passes():
        while True:
            order = list(range(len(problems)))
            rng.shuffle(order)
            yield from (problems[i] for i in order)
    gen = (make(rng) for _ in itertools.count()) if problems is None else passes()
    return itertools.islice(gen, start, None)
