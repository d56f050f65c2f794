"""The package's shape, measured from its imports: the contract at the ground floor, no circles, no giant.

These hold the architecture the README describes: the contract imports nothing of the package but
``errors``; no module imports another that (directly or not) imports it back, imports inside functions
counted (a lazy import reaching up a floor is still a circle); no top-level folder or
module holds more than a third of the lines; and tests and benchmarks reach no private member of a
runtime or backend (they use the documented ``diagnostics()`` hook).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import exllama_integrations

ROOT = Path(exllama_integrations.__file__).parent
REPO = ROOT.parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _import_nodes(nodes: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``nodes``, at any depth (in functions and methods too: a lazy import is still
    an import), except in ``if TYPE_CHECKING:`` blocks, which never run."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = list(nodes)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test):
            stack.extend(n.orelse)
            continue
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            found.append(n)
            continue
        stack.extend(ast.iter_child_nodes(n))
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """What a module imports of the package, at import time or later in a function (``TYPE_CHECKING`` blocks
    are not imports)."""
    deps: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for n in _import_nodes(ast.parse(path.read_text()).body):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = package.split(".")
                base = base[: len(base) - (n.level - 1)]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            for a in n.names:
                full = f"{target}.{a.name}"
                deps.add(full if full in modules else target)
        else:
            deps.update(a.name for a in n.names)
    return {d for d in deps if d in modules and d != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_there_is_no_import_circle():
    graph, state, circles = _graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                circles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert circles == [], "\n".join(circles)


def test_the_contract_is_the_ground_floor():
    graph = _graph()
    contract = {n for n in graph if n.startswith("exllama_integrations.contract")}
    for name in contract:
        outside = graph[name] - contract - {"exllama_integrations.errors"}
        assert not outside, f"{name} imports {sorted(outside)}"
    assert graph["exllama_integrations.errors"] == set()


def test_no_folder_or_module_holds_more_than_a_third_of_the_package():
    sizes: dict[str, int] = {}
    for p in ROOT.rglob("*.py"):
        top = p.relative_to(ROOT).parts[0]
        sizes[top] = sizes.get(top, 0) + len(p.read_text().splitlines())
    total = sum(sizes.values())
    biggest = max(sizes, key=lambda k: sizes[k])
    assert sizes[biggest] / total < 0.33, f"{biggest} holds {sizes[biggest]} of {total} lines"


def test_tests_and_benchmarks_reach_no_private_member_of_a_runtime():
    private = re.compile(r"\._backend\b|\._generator\b|\._inbox\b|\._stream\(")
    found = [
        f"{p.relative_to(REPO)}:{i}"
        for folder in ("tests", "benchmarks")
        for p in (REPO / folder).rglob("*.py")
        if p.name != "test_structure.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == [], "use runtime.diagnostics() instead"


MAX_MODULE_LINES = 450


def test_no_module_is_over_450_lines():
    over = {}
    for p in ROOT.rglob("*.py"):
        name, lines = p.relative_to(ROOT).as_posix(), len(p.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            over[name] = lines
    assert over == {}, "split these by role (one module, one job)"


def test_the_chat_apis_share_one_file_vocabulary_and_a_declared_conversion():
    """Chat completions, the Responses API and the Messages API keep the same roles in files of the same names,
    and each turns its body into the chat request through a conversion declared as a ``typing.Protocol``."""
    import importlib
    import inspect
    from typing import Protocol

    from exllama_integrations.serve.conversion import ChatBody, ChatContext, ToChat
    from exllama_integrations.serve.state import ServeState

    for api in ("openai", "responses", "anthropic"):
        folder = ROOT / "serve" / api
        for role in ("protocol", "convert", "stream", "endpoint"):
            assert (folder / f"{role}.py").exists() or (folder / role / "__init__.py").exists(), (api, role)
        to_chat = importlib.import_module(f"exllama_integrations.serve.{api}.convert").to_chat
        params = inspect.signature(to_chat).parameters
        assert list(params) == ["body", "context"] and params["context"].annotation in ("ChatContext", ChatContext)
    assert all(Protocol in p.__mro__ for p in (ChatBody, ToChat))
    prepare = inspect.signature(ServeState.prepare).parameters
    assert not any(p.kind is p.VAR_POSITIONAL for p in prepare.values())  # no positional to_chat(*args) any more
    assert list(prepare)[:3] == ["self", "body", "to_chat"]
