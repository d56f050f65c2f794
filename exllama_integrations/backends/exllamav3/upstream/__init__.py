"""The one boundary to exllamav3: every exllamav3 name this package uses is imported here, and declared.

``from ..upstream import Model`` (inside a function: importing this package imports nothing of exllamav3) gives
the name :data:`.requirements.NAMES` maps it to, imported from the module that defines it when first asked for;
:func:`module` gives the few exllamav3 modules reached as modules. No other module of the package imports exllamav3
(tests/unit/test_exllamav3_boundary.py checks it). What the backend relies on beyond the names (members read,
written or wrapped, parameters passed by keyword, ``params`` keys) is declared beside them, in :mod:`.requirements`
(the backend's modules) and :mod:`..fast.requirements` (the fast path's seam), and checked against exllamav3's
source without importing it (:mod:`.depends`; ``python -m exllama_integrations.backends.exllamav3.fast``).

A name that does not import raises :class:`ImportError` as the import statement would (the upstream fixes and the
seam stand aside on it); a name not declared raises :class:`AttributeError`: declare it first.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .requirements import MODULES, NAMES


def __getattr__(name: str) -> Any:
    """exllamav3's ``name`` (see :data:`.requirements.NAMES`)."""
    where = NAMES.get(name)
    if where is None:
        raise AttributeError(f"{name!r} is not an exllamav3 name declared in upstream/requirements.py (NAMES)")
    # __import__ (not importlib): a test that takes exllamav3 away by replacing builtins.__import__ reaches here too
    return getattr(__import__(where, fromlist=[name]), name)


def module(name: str) -> ModuleType:
    """The exllamav3 module ``name``, one of :data:`.requirements.MODULES` (for a module global of its own)."""
    if name not in MODULES:
        raise AttributeError(f"{name!r} is not an exllamav3 module declared in upstream/requirements.py (MODULES)")
    return __import__(name, fromlist=["_"])


__all__ = ["module"]
