"""The quick tier (tests/tiers.py) reaches every module of the package: each is imported, directly or through the
modules it imports (in functions too), by at least one test file the tier runs tests of."""

from __future__ import annotations

import ast
from pathlib import Path

from test_structure import REPO, _graph, _import_nodes, _modules
from tiers import NOT_QUICK, QUICK, is_quick

TESTS = REPO / "tests"


def _quick_files() -> list[Path]:
    files = set()
    for prefix in QUICK:
        path = REPO / prefix.split("::")[0]
        found = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        assert found and all(p.is_file() for p in found), f"tests/tiers.py names {prefix}, which does not exist"
        files |= {p for p in found if is_quick(str(p.relative_to(REPO)) + "::")}
    return sorted(files)


def _named(path: Path, modules: set[str]) -> set[str]:
    """The package's modules a test file imports, or names as a string (``python -m ...``, ``import_module``)."""
    tree = ast.parse(path.read_text())
    named = set()
    for n in _import_nodes(tree.body):
        if isinstance(n, ast.ImportFrom) and not n.level and n.module:
            named |= {n.module, *(f"{n.module}.{a.name}" for a in n.names)}
        elif isinstance(n, ast.Import):
            named |= {a.name for a in n.names}
    return (named & modules) | _strings(path, modules)


def _strings(path: Path, modules: set[str], package: str = "") -> set[str]:
    """Modules a file names in a string: imported by name (``import_module``, ``"module:Class"``, a name relative to
    its ``package``) or run (``python -m``: its ``__main__``)."""
    tree = ast.parse(path.read_text())
    texts = {n.value.split(":")[0] for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    named = (texts | {f"{package}.{t}" for t in texts if package}) & modules
    if "-m" in texts:
        named |= {f"{m}.__main__" for m in named} & modules
    return named


def _reached() -> set[str]:
    graph = _graph()
    modules = set(graph)
    for name, path in _modules().items():  # lazy imports by name (a registry of "package.module" strings)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = graph[name] | _strings(path, modules, package)
    todo = {m for f in _quick_files() for m in _named(f, set(graph))}
    todo |= {m for f in TESTS.glob("*.py") for m in _named(f, set(graph))}  # helpers the quick tests use
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo |= {".".join(parts[:i]) for i in range(1, len(parts))}  # importing a.b.c imports a and a.b
        todo |= graph.get(name, set())  # (a folder without __init__.py imports nothing)
    return seen


def test_every_module_is_imported_by_a_quick_test():
    missing = sorted(set(_graph()) - _reached())
    assert not missing, f"no quick test reaches {missing}: add one of its tests to tests/tiers.py's QUICK"


def test_the_tier_names_only_what_exists():
    assert _quick_files()
    for prefix in NOT_QUICK:
        assert (REPO / prefix.split("::")[0]).is_file(), prefix
