"""What a library's installed source says about the members we rely on, read without importing it.

The backend declares what of exllamav3 it imports, reads, writes and wraps (:mod:`.requirements` for the backend's
modules, :mod:`..fast.requirements` for the fast path's seam): module names, class members, the parameter names of
the methods it calls or wraps, the keys of the ``params`` dicts exllamav3 builds for the forwards it replaces, and
the ``params`` keys it hands exllamav3's forwards. Here those declarations are checked against a library's source
files with :mod:`ast` (no import: it works on a machine without CUDA, and a module that fails to import still has
its facts read), against a recorded copy of a release's facts (``recorded/``), and a release is compared by PEP 440
release number, local labels such as ``+cu128.torch2.9.0`` (exllamav3's own CUDA wheels) ignored.

The command line (``python -m exllama_integrations.backends.exllamav3.fast``) is in ``fast/__main__.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).with_name("recorded")
"""Facts of the verified releases, as :func:`facts` read them from their source (``exllamav3-<release>.json``)."""


@dataclass(frozen=True)
class Member:
    """A member of a class.

    A method (with the parameter names it must begin with, ``self`` left out, and the ``keywords`` it must take by
    name wherever they stand), a property, an attribute assigned in the class body or on ``self`` in one of its
    methods.
    """

    module: str
    cls: str
    name: str
    params: tuple[str, ...] | None = None
    keywords: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        return f"{self.module}:{self.cls}.{self.name}"


@dataclass(frozen=True)
class DictKeys:
    """The keys of the first dict literal assigned to ``var`` in ``cls.func``: all must be among ``known``."""

    module: str
    cls: str
    func: str
    var: str
    known: frozenset[str]

    @property
    def key(self) -> str:
        return f"{self.module}:{self.cls}.{self.func}:{self.var}"


@dataclass(frozen=True)
class Constant:
    """A module-level name (assigned, or imported into the module), and the literal value it must have if given."""

    module: str
    name: str
    value: int | str | None = None

    @property
    def key(self) -> str:
        return f"{self.module}:{self.name}"


@dataclass(frozen=True)
class Reads:
    """How often ``cls.func`` reads an attribute chain (``self.pagetable.all_pages``): it must be ``times``.

    For a wrap that changes what one read sees (a view of an object, for the duration of a call): another read of
    the same chain, or none, in a new release means the wrap would change something else, or nothing.
    """

    module: str
    cls: str
    func: str
    chain: str
    times: int = 1

    @property
    def key(self) -> str:
        return f"{self.module}:{self.cls}.{self.func}:reads {self.chain}"


@dataclass(frozen=True)
class Mentions:
    """``cls.func`` spells the string ``text`` (a ``params`` key it reads: ``params.get("export_states")``)."""

    module: str
    cls: str
    func: str
    text: str

    @property
    def key(self) -> str:
        return f"{self.module}:{self.cls}.{self.func}:mentions {self.text!r}"


@dataclass(frozen=True)
class Function:
    """A module-level function, with the ``keywords`` it must take by name (the pins call it by keyword)."""

    module: str
    name: str
    keywords: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.module}:{self.name}()"


@dataclass(frozen=True)
class Calls:
    """The module-level function ``func`` calls ``callee`` by its bare name.

    So a wrap of the module's global reaches the call (the pins wrap ``paged_attn_triton_decode`` where the attention
    dispatcher's functions call it).
    """

    module: str
    func: str
    callee: str

    @property
    def key(self) -> str:
        return f"{self.module}:{self.func}() calls {self.callee}"


@dataclass(frozen=True)
class Bound:
    """A function of exllamav3's compiled extension, called positionally.

    Bound in ``exllamav3_ext/bindings.cpp`` (``m.def("name"``) and declared in ``header`` (under ``exllamav3_ext/``)
    with parameters named ``params``, in order. The wheel ships the extension's sources (it compiles them on first
    import); without them it is unmet.
    """

    name: str
    header: str
    params: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"exllamav3_ext:{self.name}"


Requirement = Member | DictKeys | Constant | Reads | Mentions | Function | Calls | Bound


def release(version: str) -> tuple[int, ...] | None:
    """The release number of a PEP 440 version (``1.6.5+cu128.torch2.9.0`` -> ``(1, 6, 5)``), None if invalid."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return None


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def source_root(package: str) -> Path | None:
    """The folder of an installed package's source, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


class _Module:
    """One source file's classes and top-level names."""

    def __init__(self, path: Path) -> None:
        self.source = path.read_text(encoding="utf-8")
        tree = ast.parse(self.source, filename=str(path))
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.names: set[str] = set()
        self.values: dict[str, Any] = {}  # NAME = <literal>
        for n in tree.body:
            if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    self.names |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
                    if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant):
                        self.values[t.id] = n.value.value
            elif isinstance(n, ast.ImportFrom | ast.Import):
                self.names |= {(a.asname or a.name).split(".")[0] for a in n.names}
            elif isinstance(n, ast.FunctionDef | ast.ClassDef):
                self.names.add(n.name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for n in cls.body:
        if isinstance(n, ast.FunctionDef) and n.name == name:
            return n
    return None


def _members(cls: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for n in cls.body:
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):  # self.X = ... in any method
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                    out.add(x.attr)
    return out


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _fingerprint(fn: ast.FunctionDef, source: str) -> str:
    """A short hash of a function's code: its lines, less the docstring, blank lines, comment lines, indentation.

    Plain text, so the same on every Python version (an AST dump is not: 3.12 added fields to nested functions; nor
    are tokens: 3.12 splits f-strings). A changed trailing comment counts as a change: a false alarm, read away in
    the runbook.
    """
    import hashlib

    first = fn.body[0]
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    lines = source.splitlines()
    kept = lines[fn.lineno - 1 : first.lineno - 1]  # the signature
    if doc and len(fn.body) > 1:
        kept += lines[fn.body[1].lineno - 1 : fn.end_lineno]
    elif not doc:
        kept += lines[first.lineno - 1 : fn.end_lineno]
    text = "\n".join(x.strip() for x in kept if x.strip() and not x.strip().startswith("#"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dict_keys(fn: ast.FunctionDef, var: str) -> list[str] | None:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            if any(isinstance(t, ast.Name) and t.id == var for t in node.targets):
                return [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return None


def _reads(fn: ast.FunctionDef, chain: str) -> int:
    """Attribute chains spelled ``chain`` in ``fn`` (``a.b.c``: the outermost node of each counted once)."""

    def spelled(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            inner = spelled(node.value)
            return None if inner is None else f"{inner}.{node.attr}"
        return None

    return sum(isinstance(n, ast.Attribute) and spelled(n) == chain for n in ast.walk(fn))


def _mentions(fn: ast.FunctionDef, text: str) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == text for n in ast.walk(fn))


def _calls(fn: ast.FunctionDef, callee: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == callee for n in ast.walk(fn))


def _bound(root: Path, r: Bound) -> dict[str, Any]:
    """Whether bindings.cpp binds ``r.name``, and the parameter names of its declaration in ``r.header``."""
    import re

    ext = root / "exllamav3_ext"
    bindings, header = ext / "bindings.cpp", ext / r.header
    if not bindings.is_file() or not header.is_file():
        return {"present": False}
    present = f'm.def("{r.name}"' in bindings.read_text(errors="replace")
    decl = re.search(rf"\b{re.escape(r.name)}\s*\(([^;{{]*?)\)\s*;", header.read_text(errors="replace"))
    params = None
    if decl is not None:  # each parameter's name: the last word before a default value, if any
        params = [re.findall(r"\w+", p.split("=")[0])[-1] for p in decl.group(1).split(",") if p.strip()]
    return {"present": present, "params": params}


def facts(root: Path, requirements: list[Requirement]) -> dict[str, Any]:
    """What the source under ``root`` (the package's folder) says about each requirement, by its key.

    A member: ``{"present": bool, "params": [...]}`` (params for methods); dict keys: ``{"keys": [...]}`` or
    ``{"keys": None}`` when the dict is not found; a constant: ``{"present": bool, "value": ...}`` (its value when a
    literal is assigned); reads: ``{"reads": n}`` (None: the method is not found); mentions: ``{"mentions": bool}``
    (None: the method is not found).
    """
    cache: dict[str, _Module | None] = {}

    def module(name: str) -> _Module | None:
        if name not in cache:
            rel = Path(*name.split(".")[1:])
            path = next((p for p in (root / rel.with_suffix(".py"), root / rel / "__init__.py") if p.is_file()), None)
            cache[name] = _Module(path) if path is not None else None
        return cache[name]

    out: dict[str, Any] = {}
    for r in requirements:
        if isinstance(r, Bound):
            out[r.key] = _bound(root, r)
            continue
        m = module(r.module)
        if isinstance(r, Function | Calls):
            fn = m.functions.get(r.name if isinstance(r, Function) else r.func) if m is not None else None
            if isinstance(r, Function):
                out[r.key] = {"present": fn is not None, **({"params": _params(fn)} if fn is not None else {})}
            else:
                out[r.key] = {"calls": _calls(fn, r.callee) if fn is not None else None}
            continue
        if isinstance(r, Constant):
            out[r.key] = {"present": m is not None and r.name in m.names}
            if m is not None and r.name in m.values:
                out[r.key]["value"] = m.values[r.name]
            continue
        cls = m.classes.get(r.cls) if m is not None else None
        if isinstance(r, Reads):
            fn = _method(cls, r.func) if cls is not None else None
            out[r.key] = {"reads": _reads(fn, r.chain) if fn is not None else None}
        elif isinstance(r, Mentions):
            fn = _method(cls, r.func) if cls is not None else None
            out[r.key] = {"mentions": _mentions(fn, r.text) if fn is not None else None}
        elif isinstance(r, Member):
            fn = _method(cls, r.name) if cls is not None else None
            present = cls is not None and r.name in _members(cls)
            body = {"params": _params(fn), "body": _fingerprint(fn, m.source)} if fn is not None and m else {}
            out[r.key] = {"present": present, **body}
        else:
            fn = _method(cls, r.func) if cls is not None else None
            out[r.key] = {"keys": _dict_keys(fn, r.var) if fn is not None else None}
    return out


def problems(requirements: list[Requirement], found: dict[str, Any]) -> list[str]:
    """What of ``requirements`` the facts ``found`` do not meet, each said in a line (empty: all met)."""
    out = []
    for r in requirements:
        f = found.get(r.key)
        if f is None:
            out.append(f"{r.key}: not checked")
        elif isinstance(r, Member | Constant | Function | Bound) and not f.get("present"):
            out.append(f"{r.key}: missing")
        elif isinstance(r, Function) and set(r.keywords) - set(f.get("params") or ()):
            lacking = sorted(set(r.keywords) - set(f.get("params") or ()))
            out.append(f"{r.key}: parameters {f.get('params')} lack {lacking}")
        elif isinstance(r, Bound) and tuple(f.get("params") or ()) != r.params:
            out.append(f"{r.key}: declared with parameters {f.get('params')}, called as {list(r.params)}")
        elif isinstance(r, Calls) and not f.get("calls"):
            out.append(f"{r.key}: not found (a wrap of the module's {r.callee} would not reach the call)")
        elif isinstance(r, Constant) and r.value is not None and f.get("value") != r.value:
            out.append(f"{r.key}: is {f.get('value')!r}, the fast path assumes {r.value!r}")
        elif isinstance(r, Member) and (r.params is not None or r.keywords is not None):
            got = f.get("params")
            if r.params is not None and (got is None or tuple(got[: len(r.params)]) != r.params):
                out.append(f"{r.key}: parameters {got} do not begin with {list(r.params)}")
            elif r.keywords is not None and (got is None or set(r.keywords) - set(got)):
                out.append(f"{r.key}: parameters {got} lack {sorted(set(r.keywords) - set(got or ()))}")
        elif isinstance(r, Mentions):
            if not f.get("mentions"):
                out.append(f"{r.key}: not found (the backend hands or reads it)")
        elif isinstance(r, Reads):
            if f.get("reads") != r.times:
                out.append(f"{r.key}: read {f.get('reads')} times, the seam assumes {r.times}")
        elif isinstance(r, DictKeys):
            keys = f.get("keys")
            if keys is None:
                out.append(f"{r.key}: no dict literal assigned to {r.var!r} found")
            elif set(keys) - r.known:
                out.append(f"{r.key}: keys {sorted(set(keys) - r.known)} are new (the captured forward lacks them)")
    return out


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The requirements whose facts differ between two readings (a verified release's and another's).

    Methods whose code changed, members that appeared or went, dict keys that moved: what the runbook reads before a
    release joins the verified set (docs/exllamav3-releases.md).
    """
    return [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]


def recorded(release_text: str) -> dict[str, Any] | None:
    """The recorded facts of a release (``"1.6.5"``), or None."""
    path = RECORDED / f"exllamav3-{release_text}.json"
    return json.loads(path.read_text()) if path.is_file() else None
