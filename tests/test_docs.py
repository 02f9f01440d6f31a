"""What the docs cite exists: every `module.Name` a docstring or comment of the core, ext/ or tools/ names,
and every one in README.md's and DESIGN.md's code spans, is defined in that module (not just imported
there). A rename that leaves a docstring behind fails here."""

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
FILES = [p for d in (ROOT, ROOT / "ext", ROOT / "tools") for p in sorted(d.glob("*.py"))]
ROOTS = {p.stem for p in ROOT.glob("*.py")}
DOTTED = re.compile(r"(?<![\w./])((?:ext\.|tools\.)?[a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)")    # buffer.Freshness
SLASHED = re.compile(r"(?<![\w./])(ext|tools)/([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)")      # ext/lora.LoraWeights
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "png", "txt", "log", "safetensors"}
NOT_MODULES = {"self", "cfg", "t", "c", "s", "e", "p"}      # variables a docstring may name


def cited() -> list[tuple[str, str, str]]:
    """(where, module, name) for every citation in the docstrings, the comments and the two documents' code
    spans."""
    texts = []
    for p in FILES:
        where, source = str(p.relative_to(ROOT)), p.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                texts.append((where, ast.get_docstring(node) or ""))
        texts += [(where, tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                  if tok.type == tokenize.COMMENT]
    for doc in ("README.md", "DESIGN.md"):
        texts += [(doc, span) for span in re.findall(r"`([^`\n]+)`", (ROOT / doc).read_text())]
    out = []
    for where, text in texts:
        out += [(where, f"{d}.{m}", n) for d, m, n in SLASHED.findall(text)]
        out += [(where, m, n) for m, n in DOTTED.findall(text)]
    return [x for x in out if x[2] not in FILE_SUFFIXES]


def defined(module: str) -> set[str] | None:
    """The names a project module defines at its top level (or, for a class, in its body); None: no such
    module in the project."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        return None
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def third_party(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def test_every_module_name_the_docs_cite_exists():
    missing = set()
    for where, module, name in cited():
        names = defined(module)
        explicit = module.startswith(("ext.", "tools."))
        if explicit or (module in ROOTS and name[0].isupper()):
            # a project module's class or constant (a lowercase name after a root module's name is as often a
            # variable's method: proxy.generate)
            if names is None or name not in names:
                missing.add(f"{where}: {module}.{name}")
        elif name[0].isupper() and module not in NOT_MODULES and not third_party(module):
            missing.add(f"{where}: {module}.{name} (no module {module})")
    assert not missing, "cited but not defined there:\n" + "\n".join(sorted(missing))


def test_the_check_finds_a_stale_citation():
    """A citation of a class that moved away (its module no longer defines it) is found."""
    assert "ENVS" in defined("rollout") and "ENVS" not in defined("env_manager")   # (env_manager imports it)
    assert defined("microbatch") is None and defined("ext.lora") is not None
    assert ("x", "env_manager", "ENVS") in [("x", m, n) for m, n in DOTTED.findall("see env_manager.ENVS")]


def resolve(dotted: str):
    """The object `module.Name.attr...` names: the longest importable module prefix, then attributes."""
    import importlib
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_every_function_the_tour_names_exists():
    """docs/tour.md names the real functions in the order they run: each code span that is a dotted name
    resolves to an object of this tree, and the commands it shows exist."""
    tour = (ROOT / "docs" / "tour.md").read_text()
    names = sorted({s for s in re.findall(r"`([a-z_]+(?:\.\w+)+)`", tour) if not s.endswith((".py", ".md"))})
    assert len(names) > 40                                                   # (the tour names its anchors)
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing, "docs/tour.md names what does not exist:\n" + "\n".join(missing)
    from tools import sim
    assert "sweep" in sim.EXPERIMENTS and "python -m tools.sim sweep" in tour
