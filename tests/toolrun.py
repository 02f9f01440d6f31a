"""Helpers for the tools' smoke tests (test_tools_*.py): run `python -m tools.NAME ARGS` in this process, as
the command runs it, and read what it printed.

run_tool runs the module's `if __name__ == "__main__":` block (runpy, argv as on the command line), so a
test can first swap out what is slow and tested elsewhere by patching the module it comes from (a tool
that does `from tools.jobs import run_to_end` picks up a patched tools.jobs.run_to_end: its code runs
afresh here)."""

import contextlib
import io
import json
import math
import runpy
import sys
import warnings


def run_tool(module: str, argv: list[str]) -> str:
    """`python -m MODULE ARGV...` in this process; what it printed. A SystemExit other than 0 fails, with
    the output so far."""
    out, saved = io.StringIO(), sys.argv
    sys.argv = [module, *argv]
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            # (a tool another tool imported is already in sys.modules: runpy says so, and runs it afresh)
            warnings.filterwarnings("ignore", "'tools.* found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise AssertionError(f"python -m {module} {' '.join(argv)} exited with {e.code!r}; it printed:\n"
                                 f"{out.getvalue()[-3000:]}") from None
    finally:
        sys.argv = saved
    return out.getvalue()


def last_json(text: str):
    """The last JSON object printed at the start of a line (the tools end with one, indented or not)."""
    for start in reversed([0] + [i + 1 for i, c in enumerate(text) if c == "\n"]):
        if text.startswith("{", start):
            try:
                return json.JSONDecoder().raw_decode(text[start:])[0]
            except ValueError:
                continue
    raise AssertionError(f"no JSON object in the output:\n{text[-2000:]}")


def finite(*values) -> bool:
    """Every value a finite number (not None, not NaN, not a bool)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
