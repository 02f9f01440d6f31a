"""Style: every line of the project's Python is at most 110 characters (ruff.toml: E501 only)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_line_length():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"ruff check . (ruff.toml: line-length 110):\n{r.stdout}{r.stderr}"
