"""task.py: the default task, the reward checkers and the dataset reader.

The embedded default task is procedurally generated integer addition, written for the tiny
character-level model (tiny_model.py):

    prompt   "37+485="        answer "522"        response "522<eos>"

Difficulty is the number of digits per operand (drawn from `digits`), so a short supervised warm
start leaves the tiny model with partial skill (around 20-60% sampled accuracy) and RL has room to
show. The reward is 1.0 for an exact answer and 0.0 otherwise, which is the verifiable-reward setting
of the paper (RLVR).

Real models pass `--data PATH`: JSONL or parquet rows with a prompt and an answer, rewarded with
math-verify (the checker the ROLL and DAPO recipes use for math).

`target_len` (optional, per problem) lets benchmarks draw long-tailed response lengths: the rollout
side then asks the engine for exactly that many tokens (ignore_eos), so a prompt's generation time
follows a chosen distribution even though the tiny model's answers are short.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Problem:
    prompt: str             # text given to the model
    answer: str             # reference answer the verifier checks against
    kind: str = "add"       # "add" for the default task, "math" for --data rows
    target_len: int = 0     # >0: benchmark mode, generate exactly this many tokens


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


def load_dataset(path: str) -> list[Problem]:
    """Read JSONL (.jsonl/.json) or parquet rows with a prompt and an answer field.

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
    problems = [Problem(_pick(r, PROMPT_KEYS, w), _pick(r, ANSWER_KEYS, w), kind="math") for w, r in rows]
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


def reward(problem: Problem, response: str) -> float:
    """Verifier reward in [0, 1] for one response text."""
    if problem.kind == "add":
        return reward_add(response, problem.answer)
    return reward_math(response, problem.answer)
