"""task.py: the default task, the verifiers, and the dataset reader's errors."""

import json

import pytest

import task

pytestmark = pytest.mark.fast


def test_default_task_is_deterministic_and_verifiable():
    a, b = task.make_problems(50, seed=1), task.make_problems(50, seed=1)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    for p in a:
        x, y = p.prompt.rstrip("=").split("+")
        assert int(p.answer) == int(x) + int(y)
        assert task.reward(p, p.answer) == 1.0 and task.reward(p, p.answer + "1") == 0.0


def test_math_verify_reward():
    p = task.Problem("What is 1/2 + 1/4?", "3/4", kind="math")
    assert task.reward(p, "The answer is $\\frac{3}{4}$") == 1.0
    assert task.reward(p, "The answer is $0.75$") == 1.0
    assert task.reward(p, "The answer is $\\frac{2}{3}$") == 0.0


def test_load_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": "1+1?", "answer": "2"}, {"question": "2+2?", "solution": "4"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = task.load_dataset(str(path))
    assert [(p.prompt, p.answer, p.kind) for p in got] == [("1+1?", "2", "math"), ("2+2?", "4", "math")]
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"prompt": "3+3?", "answer": "6"}]), tmp_path / "d.parquet")
    assert task.load_dataset(str(tmp_path / "d.parquet"))[0].answer == "6"


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a", "answer": "1"}\n{not json}\n', r"d.jsonl line 2: not valid JSON"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', r"d.jsonl line 2: row has none of the fields"),
    ('[1, 2]\n', r"d.jsonl line 1: expected a JSON object"),
    ('\n', r"no rows"),
])
def test_malformed_rows_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        task.load_dataset(str(path))


def test_missing_file_is_named():
    with pytest.raises(FileNotFoundError, match="--data /nope.jsonl"):
        task.load_dataset("/nope.jsonl")


def test_response_len_budget_is_the_prompts_own_lognormal_draw():
    """--response-len-median: every generated prompt carries one budget (a deferred prompt keeps it),
    lognormal around the median; off, no budget."""
    import random
    import statistics
    from config import Extensions, parse_cli
    from train import Config
    cfg = parse_cli(Config, ["--response-len-median", "8", "--response-len-sigma", "1.0",
                             "--eval-every", "1"])
    _, make, held_out = cfg.data.sources(0, Extensions.start(cfg))
    lens = [make(random.Random(i)).target_len for i in range(2000)]
    assert 7 <= statistics.median(lens) <= 9 and max(lens) > 60 and min(lens) >= 1
    assert all(p.target_len == 0 for p in held_out)          # evaluation answers as it likes
    assert task.DataConfig().sources(0, Extensions())[1](random.Random(0)).target_len == 0
