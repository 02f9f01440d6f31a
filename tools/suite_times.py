"""tools/suite_times.py: where the test suite's time goes, per test file and per tier (results/suite.md).

    python -m tools.suite_times --run      # the quick tier, then the whole suite (each as run.sh runs it,
                                           # JUnit reports to /tmp), then results/suite.md
    python -m tools.suite_times FULL.xml [FAST.xml] --how TEXT --out results/suite.md   # from reports written
                                           # before (--how: how they were made, e.g. on a fresh clone)

A report is pytest's JUnit XML (--junitxml); a test's seconds are its set-up, call and tear-down together,
so a session fixture's build (a model) counts in the first test that uses it. The markers of each test (fast,
engine, gpu) come from the report's properties, which tests/conftest.py records. Run it on a quiet machine:
the figures are wall-clock seconds.
"""

import argparse
import collections
import datetime
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


RUN_HOW = ("`python -m tools.suite_times --run`: the quick tier (`bash run.sh test fast`), then the whole "
           "suite (`bash run.sh test`, the README's and CI's command), set-up done beforehand")


def read(report: Path) -> tuple[list[dict], float]:
    """([{file, name, seconds, outcome, markers}], the run's wall seconds as pytest measured them)."""
    root = ET.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests = []
    for case in suite.iter("testcase"):
        bad = [e.tag for e in case if e.tag in ("failure", "error", "skipped")]
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        parts = case.get("classname", "").split(".")          # tests.test_x (or tests.test_x.Class)
        tests.append({"file": next((p for p in parts if p.startswith("test_")), parts[-1]) + ".py",
                      "name": case.get("name"), "seconds": float(case.get("time") or 0),
                      "outcome": bad[0] if bad else "passed",
                      "markers": set(filter(None, props.get("markers", "").split(",")))})
    return tests, float(suite.get("time") or 0)


def table(full: list[dict], wall: float, fast: list[dict] | None, fast_wall: float | None, when: str,
          how: str = "") -> str:
    how = how or RUN_HOW
    by_file: dict[str, list[dict]] = collections.defaultdict(list)
    for t in full:
        by_file[t["file"]].append(t)
    outcomes = collections.Counter(t["outcome"] for t in full)
    in_fast = [t for t in full if "fast" in t["markers"]]
    lines = [
        "# The test suite's time",
        "",
        f"Measured {when} on this machine (2 cores, no GPU) by {how}. A test's seconds include its "
        "fixtures' set-up (a model build counts in the first test that uses it).",
        "",
        "| tier | tests | seconds (pytest's wall clock) |",
        "|---|---:|---:|",
        f"| the whole suite | {len(full)} ({outcomes['passed']} passed, {outcomes['skipped']} skipped, "
        f"{outcomes['failure'] + outcomes['error']} failed) | {wall:.0f} ({wall / 60:.1f} min) |",
    ]
    if fast is not None:
        lines.append(f"| the quick tier (`-m fast`) | {len(fast)} | {fast_wall:.0f} |")
    lines.append(f"| tests marked engine (real vLLM), in the whole suite | "
                 f"{sum('engine' in t['markers'] for t in full)} | "
                 f"{sum(t['seconds'] for t in full if 'engine' in t['markers']):.0f} |")
    lines += ["", "Per file, slowest first (fast: the file's tests in the quick tier, and their seconds in "
              "the whole suite's run):", "",
              "| file | tests | seconds | slowest test (seconds) | fast | fast seconds |",
              "|---|---:|---:|---|---:|---:|"]
    for f, ts in sorted(by_file.items(), key=lambda kv: -sum(t["seconds"] for t in kv[1])):
        slow = max(ts, key=lambda t: t["seconds"])
        fs = [t for t in ts if "fast" in t["markers"]]
        lines.append(f"| {f} | {len(ts)} | {sum(t['seconds'] for t in ts):.1f} | {slow['name'][:70]} "
                     f"({slow['seconds']:.1f}) | {len(fs)} | {sum(t['seconds'] for t in fs):.1f} |")
    fast_s = sum(t["seconds"] for t in in_fast)
    lines += ["", f"Tests marked fast: {len(in_fast)}, {fast_s:.0f} s of the whole suite's run.", ""]
    return "\n".join(lines)


def run(args: list[str], report: Path) -> float:
    """bash run.sh test ARGS with a JUnit report; its wall seconds (the process's, start-up included)."""
    t = time.monotonic()
    subprocess.run(["bash", "run.sh", "test", *args, f"--junitxml={report}", "-q", "-p", "no:cacheprovider"],
                   cwd=ROOT, check=False)
    return time.monotonic() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="*", help="FULL.xml [FAST.xml]: JUnit reports of the suite and the tier")
    ap.add_argument("--run", action="store_true", help="run both tiers first (reports under /tmp)")
    ap.add_argument("--out", default=str(ROOT / "results" / "suite.md"))
    ap.add_argument("--how", default=RUN_HOW, help="with reports: how they were made (the first line)")
    args = ap.parse_args(argv)
    if args.run:
        fast_xml, full_xml = Path("/tmp/suite-fast.xml"), Path("/tmp/suite-full.xml")
        fast_s = run(["fast"], fast_xml)
        full_s = run([], full_xml)
        print(f"quick tier: {fast_s:.0f} s; whole suite: {full_s:.0f} s (processes' wall clock)")
        args.reports = [str(full_xml), str(fast_xml)]
    if not args.reports:
        ap.error("give the JUnit reports, or --run")
    full, wall = read(Path(args.reports[0]))
    fast, fast_wall = read(Path(args.reports[1])) if len(args.reports) > 1 else (None, None)
    when = datetime.datetime.fromtimestamp(Path(args.reports[0]).stat().st_mtime).strftime("%Y-%m-%d %H:%M")
    text = table(full, wall, fast, fast_wall, when, args.how)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
