"""The one boundary to exllamav3: only ``backends/exllamav3/upstream/`` imports it; all the package uses is declared.

What is declared (:mod:`...upstream.requirements` for the backend's modules, :mod:`...fast.requirements` for the fast
path) is checked against exllamav3 1.6.5's recorded facts here, and against the installed source on the GPU machine
(tests/unit/test_fast_seam.py). These tests read the package's source: a new import of exllamav3 outside the
boundary, a name imported from it but not declared, or a new private read, write or wrap of an exllamav3 object left
undeclared fails here, before a release that changed it fails on the GPU.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from exllama_integrations.backends.exllamav3 import upstream
from exllama_integrations.backends.exllamav3.fast import requirements as fast
from exllama_integrations.backends.exllamav3.upstream import depends
from exllama_integrations.backends.exllamav3.upstream import requirements as backend

PACKAGE = Path(__file__).resolve().parents[2] / "exllama_integrations"
BACKEND = PACKAGE / "backends" / "exllamav3"
BOUNDARY = "backends/exllamav3/upstream/"
ALL = [*fast.REQUIREMENTS, *fast.PINNED, *backend.REQUIREMENTS]


def _trees() -> dict[str, ast.Module]:
    return {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _exllamav3_imports(tree: ast.Module) -> set[str]:
    """exllamav3 modules a source file imports: statements (in functions too) and ``__import__``/``import_module``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return {m for m in out if m == "exllamav3" or m.startswith("exllamav3.")}


def test_only_the_boundary_imports_exllamav3() -> None:
    offenders = {}
    for rel, tree in _trees().items():
        found = _exllamav3_imports(tree)
        if found and not rel.startswith(BOUNDARY):
            offenders[rel] = sorted(found)
    assert offenders == {}, "exllamav3 imported outside backends/exllamav3/upstream/: import it from there"
    inside = "def f():\n    import exllamav3.modules.attn as a\n    return __import__('exllamav3.cache')\n"
    assert _exllamav3_imports(ast.parse(inside)) == {"exllamav3.modules.attn", "exllamav3.cache"}  # (in functions too)


def _names_from_the_boundary(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Per file: the names it takes from ``upstream`` (``from .upstream import X``; ``upstream as c`` ... ``c.X``)."""
    out: dict[str, set[str]] = {}
    for rel, tree in trees.items():
        names, aliases = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and (node.module or "").endswith("upstream"):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level:
                aliases |= {a.asname or a.name for a in node.names if a.name == "upstream"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                names.add(node.attr)
        if names and not rel.startswith(BOUNDARY):
            out[rel] = names
    return out


def test_every_name_taken_from_the_boundary_is_declared_and_every_declared_name_is_taken() -> None:
    used = _names_from_the_boundary(_trees())
    own = {"module"} | {p.stem for p in (BACKEND / "upstream").glob("*.py")}  # the boundary's function, its modules
    taken = set().union(*used.values()) - own
    assert taken <= set(backend.NAMES), "declare it in upstream/requirements.py NAMES"
    assert set(backend.NAMES) <= taken, "a declared name nothing uses: remove it"
    assert {"patches.py", "extras.py", "pooling.py", "translate.py", "mtp.py", "vision.py", "backend.py"} <= {
        Path(rel).name for rel in used
    }
    declared = {r.key for r in backend.REQUIREMENTS}
    assert {f"{m}:{n}" for n, m in backend.NAMES.items()} <= declared  # each name is a requirement, checked
    for rel, tree in _trees().items():  # upstream.module("exllamav3...."): declared modules only
        for node in ast.walk(tree) if not rel.startswith(BOUNDARY) else ():
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "module" and node.args:
                arg = node.args[0]
                assert isinstance(arg, ast.Constant) and arg.value in backend.MODULES, (rel, ast.unparse(node))


def test_a_name_not_declared_is_refused_and_a_missing_exllamav3_is_an_import_error() -> None:
    with pytest.raises(AttributeError, match="not an exllamav3 name declared in upstream/requirements.py"):
        upstream.PageTable  # noqa: B018 - an internal nobody declared
    with pytest.raises(AttributeError, match="not an exllamav3 module declared"):
        upstream.module("exllamav3.generator.job")
    try:
        import exllamav3  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="exllamav3"):  # as the import statement would: fixes stand aside on it
            upstream.GatedMLP  # noqa: B018
    else:
        from exllamav3.modules.mlp import GatedMLP

        assert upstream.GatedMLP is GatedMLP


def test_the_verified_release_meets_every_requirement_and_its_recording_covers_them() -> None:
    recorded = depends.recorded("1.6.5")
    assert recorded is not None
    assert depends.problems(ALL, recorded["facts"]) == []
    assert {r.key for r in ALL} == set(recorded["facts"])  # recorded with --record after the last declaration
    assert len(backend.REQUIREMENTS) > len(fast.REQUIREMENTS)  # the backend's modules, not the fast path alone


# ---------------------------------------------------------------------- reads, writes and wraps


def _declared_members() -> set[str]:
    out = set()
    for r in ALL:
        out.add(r.name if isinstance(r, depends.Member | depends.Constant | depends.Function) else "")
        out |= set(getattr(r, "keywords", None) or ())
    return out - {""}


def _touched(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Private attributes a file reads on other objects than ``self``, and attributes it sets or wraps on them."""
    reads, writes = set(), set()

    def other(node: ast.expr) -> bool:
        return not (isinstance(node, ast.Name) and node.id in ("self", "cls"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and other(node.value) and re.match(r"_[^_]", node.attr):
            reads.add(node.attr)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        writes |= {t.attr for x in targets for t in ast.walk(x) if isinstance(t, ast.Attribute) and other(t.value)}
        if isinstance(node, ast.Call) and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if fn in ("setattr", "_wrap") and other(node.args[0]):
                writes.add(str(node.args[1].value))
            elif fn in ("getattr", "hasattr") and re.match(r"_[^_]", str(node.args[1].value)) and other(node.args[0]):
                reads.add(str(node.args[1].value))
    return reads, writes


OURS = {
    "driver.py": {"deferred"},  # LiveJob
    "draft_rule.py": {
        "last",
        "rate",
        "steps",
        "drafting_lost_below",
        "explored",
        "since",
        "spent",
        "seconds",
        "catch_ups",
        "best",
        "catch_up",
        "episode",
        "explored_cost",
        "exploring",
        "measuring",
        "switching",
    },  # buckets, arms, their costs
    "fast/decode.py": {"ahead", "kept", "pinned"},  # DecodeGraphs, JobView
    "fast/graphs.py": {"graph", "replays", "exported"},  # Shape
    "fast/prefill.py": {"length", "table", "shape"},  # the held chunk
    "fast/seam/views.py": {"fast_decode_view"},  # our view, kept on the job
    "patches.py": {"_fused_bf16_patched", "_image_spans_patched"},  # our markers on exllamav3's objects
}
"""Attributes the backend sets on objects of its own, or names its markers on exllamav3's (never exllamav3's)."""


def test_every_private_read_and_every_write_or_wrap_on_exllamav3_objects_is_declared() -> None:
    declared = _declared_members()
    undeclared = {}
    for path in sorted(BACKEND.rglob("*.py")):
        rel = path.relative_to(BACKEND).as_posix()
        if rel.startswith("upstream/"):
            continue
        reads, writes = _touched(ast.parse(path.read_text()))
        left = (reads | writes) - declared - OURS.get(rel, set())
        if left:
            undeclared[rel] = sorted(left)
    assert undeclared == {}, "declare them in upstream/requirements.py (or fast/requirements.py for the seam)"
    reads, writes = _touched(ast.parse((BACKEND / "patches.py").read_text()))
    assert {"trim_padded_out", "load_fp16", "prepare_inputs"} <= writes  # (the check sees writes and wraps)
    reads, _ = _touched(ast.parse((BACKEND / "fast/seam/views.py").read_text()))
    assert {"_get_prefetch_layers", "_bc_attn_enable"} <= reads


def test_each_module_spells_what_it_declares() -> None:
    """A declaration whose user no longer reads it is stale: the check would guard nothing."""
    stale = {}
    for user, reqs in backend.BY_USER.items():
        words = set(re.findall(r"\w+", (BACKEND / user).read_text()))
        wanted = {r.name for r in reqs if isinstance(r, depends.Member)} | {
            r.text for r in reqs if isinstance(r, depends.Mentions)
        }
        wanted -= {"__init__", "__iter__", "load_gen"}  # a constructor, ``for m in model``, ``load()``
        if wanted - words:
            stale[user] = sorted(wanted - words)
    assert stale == {}


def test_every_declared_name_is_exllamav3s_own_object() -> None:
    """Each name of the boundary imports from the module declared for it, and is the object exllamav3 exports."""
    import os
    import sys

    source = os.environ.get("EXLLAMAV3_SOURCE")
    if not source:
        pytest.skip("set EXLLAMAV3_SOURCE to an unpacked exllamav3 1.6.5 wheel (pip download exllamav3==1.6.5)")
    root = Path(__file__).resolve().parents[2]
    before, path = set(sys.modules), list(sys.path)
    sys.path.insert(0, str(root / "tests" / "gpu"))
    try:
        from preflight_exllamav3 import _import_exllamav3

        ex = _import_exllamav3(Path(source))
        for name, where in backend.NAMES.items():
            got = getattr(upstream, name)
            assert getattr(got, "__module__", where) == where, name  # defined there, not only re-exported
            if hasattr(ex, name):
                assert got is getattr(ex, name), name
        for name in backend.MODULES:
            assert upstream.module(name) is sys.modules[name]
        assert upstream.module("exllamav3.modules.attn")._bc_attn_enable in (True, False)
    finally:  # the stubs (triton, the extension) must not outlive this test
        for name in set(sys.modules) - before:
            del sys.modules[name]
        sys.path[:] = path


def test_the_release_check_reports_the_fast_paths_requirements_and_the_backends(tmp_path: Path) -> None:
    """``python -m ...exllamav3.fast --root DIR``: both lists checked, each unmet one named (a tree without them)."""
    import subprocess
    import sys

    (tmp_path / "exllamav3").mkdir()
    (tmp_path / "exllamav3" / "__init__.py").write_text("")
    cmd = [sys.executable, "-m", "exllama_integrations.backends.exllamav3.fast", "--root", str(tmp_path / "exllamav3")]
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([*cmd, "--version", "9.9.9"], capture_output=True, text=True, timeout=120, cwd=root).stderr
    assert f"the fast path: {len(fast.REQUIREMENTS)} unmet" in out
    assert f"the backend: {len(backend.REQUIREMENTS)} unmet" in out
    assert "exllamav3.modules.linear:Linear.trim_padded_out: missing" in out  # an upstream fix's, by name
    assert "against the verified 1.6.5:" in out
