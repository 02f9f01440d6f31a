"""tools/core_lines.py: the code-line count skips blank, comment and docstring lines; error paths are
told apart from other branches."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tools.core_lines import code_lines, error_lines, statement_of

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
SRC = '''"""module doc
on two lines"""
import sys   # a trailing comment does not make a line a comment


def f(x):
    """f's doc."""
    # a comment
    if x < 0:
        raise ValueError(
            "negative")
    try:
        y = (x +
             1)
    except OSError:
        sys.exit("no")
    return y
'''


def test_code_lines_skip_blank_comment_and_docstring_lines():
    tree = ast.parse(SRC)
    assert sorted(code_lines(tree, SRC)) == [3, 6, 9, 10, 11, 12, 13, 14, 15, 16, 17]


def test_error_lines_are_raises_excepts_exits_and_the_ifs_that_end_in_one():
    tree = ast.parse(SRC)
    assert sorted(error_lines(tree) & code_lines(tree, SRC)) == [9, 10, 11, 15, 16]


def test_a_continuation_line_belongs_to_its_statement_and_a_compound_statement_to_its_header():
    owner = statement_of(ast.parse(SRC))
    assert owner[14] == 13 and owner[11] == 10 and owner[9] == 9 and owner[12] == 12


def test_the_tool_counts_every_root_module():
    out = subprocess.run([sys.executable, "-m", "tools.core_lines"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert sorted(k for k in rows if k != "total") == modules
    assert int(rows["total"][0]) == sum(int(rows[m][0]) for m in modules)


def test_the_core_keeps_its_budget():
    """At most 4,000 code lines in at most 16 root files, train.py and README.md at most 300 lines each, and
    no core line that names an extension's flag or reads its config (tools/core_lines.py's docstring)."""
    from tools.core_lines import budget_errors
    assert budget_errors() == []


def test_the_budget_names_an_extra_root_file_a_long_train_py_and_an_extension_flag_in_the_core(tmp_path):
    """budget_errors on copies of the core, each broken one way, names what broke it."""
    import shutil

    from tools.core_lines import budget_errors

    def copy(name):
        d = tmp_path / name
        d.mkdir()
        for p in [*ROOT.glob("*.py"), ROOT / "README.md"]:
            shutil.copy(p, d / p.name)
        return d
    extra = copy("extra")
    (extra / "extra.py").write_text("X = 1\n")
    errors = budget_errors(extra)
    assert any("17 root .py files, over its budget of 16" in e and "extra.py" in e for e in errors), errors
    long = copy("long")
    (long / "train.py").write_text((long / "train.py").read_text() + "\n" * 300)
    assert any(e.startswith("train.py has ") and "over its budget of 300" in e for e in budget_errors(long))
    reads = copy("reads")
    (reads / "task.py").write_text((reads / "task.py").read_text()
                                   + '\n\ndef f(cfg):\n    return cfg.ext["lora"], "see --lora-rank"\n')
    errors = budget_errors(reads)
    assert any(e.startswith("task.py:") and "ext['lora']" in e for e in errors), errors
    assert any(e.startswith("task.py:") and "the flag --lora-rank" in e for e in errors), errors
