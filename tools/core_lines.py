"""tools/core_lines.py: how big the core is, in code lines, and how much of it a run executes.

    python -m tools.core_lines                       # code lines per root module (the core), and the total
    python -m tools.core_lines --under ext           # the same for another folder's modules
    python -m tools.core_lines --check               # the core's budget: exit 1 naming what breaks it
    python -m tools.core_lines --coverage FILE       # and per module: lines a run executed, the rest split
                                                     # into error paths and other branches

A code line is a line of a root .py that is not blank, not a comment and not inside a docstring (of the
module, a class or a function): an AST walk, so continuation lines of a statement count.
--coverage reads a combined coverage.py data file (coverage is not in requirements.txt:
`pip install coverage`). To record one over every process of a run (torchrun's ranks, vLLM's engine
processes):

    echo "import coverage; coverage.process_startup()" > .venv/lib/python3.11/site-packages/zz_cov.pth
    printf '[run]\\nparallel = True\\ndata_file = /tmp/cov/.coverage\\nsource = .\\nomit = .venv/*\\n' \\
        > /tmp/cov/.coveragerc
    COVERAGE_PROCESS_START=/tmp/cov/.coveragerc bash run.sh --steps 3 --batch-groups 8 --group-size 4 \\
        --out-dir /tmp/cov/run
    (cd /tmp/cov && coverage combine --rcfile .coveragerc); rm .venv/lib/python3.11/site-packages/zz_cov.pth
    python -m tools.core_lines --coverage /tmp/cov/.coverage

The budget (`--check`; tests/test_core_lines.py holds it): at most BUDGET["code_lines"] code lines in at most
BUDGET["files"] root files, train.py and README.md at most BUDGET["lines"] lines each, and no core line that
names an extension's flag in code (a string other than a docstring or an opt() help text; comments are free)
or reads an extension's config (cfg.ext["name"]): an optional capability lives in ext/, behind a seam.

A line counts as executed when the statement it belongs to ran (a def or class line: its header ran, at
import). Error paths: raise statements, except handlers, sys.exit calls, and if-blocks that end in one.
"""

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.AsyncFor, ast.While,
            ast.With, ast.AsyncWith, ast.Try)


def code_lines(tree: ast.Module, src: str) -> set[int]:
    """The code lines of a module (1-based numbers): not blank, not a comment, not in a docstring."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docs.update(range(first.lineno, first.end_lineno + 1))
    return {i for i, line in enumerate(src.splitlines(), 1)
            if line.strip() and not line.strip().startswith("#") and i not in docs}


def statement_of(tree: ast.Module) -> dict[int, int]:
    """line -> the first line of the statement it belongs to (a compound statement: its header only;
    a decorator: its def)."""
    owner = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            end = node.body[0].lineno - 1 if isinstance(node, COMPOUND) else node.end_lineno
            for i in range(node.lineno, end + 1):
                owner.setdefault(i, node.lineno)
            for d in getattr(node, "decorator_list", []):
                owner.update({i: node.lineno for i in range(d.lineno, d.end_lineno + 1)})
    return owner


def error_lines(tree: ast.Module) -> set[int]:
    """Lines of error paths: raise, except handlers, sys.exit(...), and if-blocks whose body ends in one."""
    def ends(stmt) -> bool:
        return isinstance(stmt, ast.Raise) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                                               and ast.unparse(stmt.value.func) == "sys.exit")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) or (isinstance(node, ast.stmt) and ends(node)):
            out.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.If) and ends(node.body[-1]):
            out.update(range(node.lineno, node.body[-1].end_lineno + 1))
    return out


BUDGET = {"code_lines": 4000, "files": 16, "lines": 300}


def extension_flags() -> set[str]:
    """Every flag an ext/ file declares: its Extension's config's, or those of a loss it adds."""
    import ext
    from config import EXTENSIONS, flag, leaf_fields
    from losses import ADV_SHAPERS, LOSSES
    ext.load()
    own = [c.Config for c in EXTENSIONS.values() if c.Config]
    own += [f.hparams for f in (LOSSES | ADV_SHAPERS).values()
            if getattr(f, "hparams", None) and f.__module__.startswith("ext.")]
    return {flag(f.name) for cls in own for _, f in leaf_fields(cls)}


def extension_reads(tree: ast.Module, flags_rx) -> list[tuple[int, str]]:
    """(line, what) for each place the module names an extension's flag in a string (not a docstring, not
    opt()'s help) or reads cfg.ext["name"]."""
    skip = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):     # opt(default, "help"): documentation, as a comment is
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "opt" and len(n.args) > 1:
            skip |= {id(c) for c in ast.walk(n.args[1]) if isinstance(c, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip:
            out += [(n.lineno, f"names the flag {m}") for m in flags_rx.findall(n.value)]
        elif (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "ext"
              and isinstance(n.slice, ast.Constant)):
            out.append((n.lineno, f"reads the config ext[{n.slice.value!r}]"))
    return out


def budget_errors(root: Path = ROOT) -> list[str]:
    """What breaks the core's budget (BUDGET and the module docstring's rule), each named; [] when kept."""
    files = sorted(root.glob("*.py"))
    total = sum(len(code_lines(ast.parse(p.read_text()), p.read_text())) for p in files)
    errors = []
    if total > BUDGET["code_lines"]:
        errors.append(f"the core has {total} code lines, over its budget of {BUDGET['code_lines']}")
    if len(files) > BUDGET["files"]:
        errors.append(f"the core has {len(files)} root .py files, over its budget of {BUDGET['files']}: "
                      f"{', '.join(p.name for p in files)}")
    for name in ("train.py", "README.md"):
        if (root / name).exists() and (n := len((root / name).read_text().splitlines())) > BUDGET["lines"]:
            errors.append(f"{name} has {n} lines, over its budget of {BUDGET['lines']}")
    flags = sorted(extension_flags(), key=len, reverse=True)
    rx = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, flags)) + r")(?![\w-])")
    for p in files:
        errors += [f"{p.name}:{line}: a core line {what}, an extension's: move it to ext/ (or say it in a "
                   f"comment)" for line, what in extension_reads(ast.parse(p.read_text()), rx)]
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coverage", default="", help="a combined coverage.py data file of a run")
    ap.add_argument("--under", default="", help="count this folder's modules (relative to the root) instead")
    ap.add_argument("--check", action="store_true", help="check the core's budget instead; exit 1 if broken")
    args = ap.parse_args()
    if args.check:
        errors = budget_errors()
        print("\n".join(errors) or "the core keeps its budget")
        raise SystemExit(1 if errors else 0)
    data = None
    if args.coverage:
        import coverage
        cov = coverage.Coverage(data_file=args.coverage)
        cov.load()
        data = cov.get_data()
    files = sorted((ROOT / args.under).glob("*.py"))
    if not files:
        ap.error(f"--under {args.under}: no .py files in {ROOT / args.under}")
    totals = [0, 0, 0, 0]                          # code, executed, error paths not run, other not run
    head = "" if data is None else f" {'run':>6s} {'error':>6s} {'other':>6s}"   # (the last two: not run)
    print(f"{'module':18s} {'code':>6s}" + head)
    for path in files:
        src = path.read_text()
        tree = ast.parse(src)
        code = code_lines(tree, src)
        row = [len(code)]
        if data is not None:
            ran = set(data.lines(str(path)) or [])
            owner = statement_of(tree)
            run = {i for i in code if owner.get(i, i) in ran}
            err = error_lines(tree)
            row += [len(run), len((code - run) & err), len((code - run) - err)]
        totals = [t + r for t, r in zip(totals, row)]
        print(f"{path.name:18s}" + "".join(f" {n:6d}" for n in row))
    print(f"{'total':18s}" + "".join(f" {n:6d}" for n in totals[:1 if data is None else 4])
          + f"   ({len(files)} files)")


if __name__ == "__main__":
    main()
