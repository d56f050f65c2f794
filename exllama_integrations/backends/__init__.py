"""Backends, looked up by name without importing any inference library."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any

from ..errors import BackendUnavailableError, InvalidSettingsError, UnsupportedModelError
from ..model.directory import ModelDirectory
from .base import Backend, BackendOptions, BackendRequest, RawLogprob, TokenStep, build_options

logger = logging.getLogger(__name__)

_BACKENDS = {
    "exllamav3": ("exllamav3", "ExLlamaV3Backend"),
    "exllama": ("exllama", "ExLlamaV1Backend"),
    "exllamav2": ("exllamav2", "ExLlamaV2Backend"),
    "transformers": ("transformers", "TransformersBackend"),
}
_AUTO_ORDER = ("exllamav3", "exllama", "transformers")
BACKEND_NAMES = tuple(_BACKENDS) + ("auto",)


def backend_class(name: str) -> type[Backend]:
    """The backend class for a name (imports only our module, not the library)."""
    if name not in _BACKENDS:
        raise InvalidSettingsError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}.")
    module, cls = _BACKENDS[name]
    mod = importlib.import_module(f"{__name__}.{module}")
    return getattr(mod, cls)  # type: ignore[no-any-return]


def resolve_backend(name: str, model: ModelDirectory) -> type[Backend]:
    """Pick the backend for ``name`` (``auto``: exllamav3 on CUDA, then exllama v1, then the CPU reference).

    Raises:
        MissingDependencyError / BackendUnavailableError: the named backend cannot run here.
        UnsupportedModelError: the named (or every available) backend cannot run this model.
    """
    if name != "auto":
        cls = backend_class(name)
        cls.check_available()
        cls.check_model(model)
        return cls
    reasons = []
    for candidate in _AUTO_ORDER:
        cls = backend_class(candidate)
        try:
            cls.check_available()
            cls.check_model(model)
        except (ImportError, BackendUnavailableError, UnsupportedModelError) as e:
            reasons.append(f"{candidate}: {e}")
            continue
        logger.info("backend='auto' chose %s for %s", candidate, model.name)
        return cls
    raise UnsupportedModelError("no installed backend can run this model:\n  " + "\n  ".join(reasons))


def options_for(cls: type[Backend], values: Mapping[str, Any]) -> BackendOptions:
    """The backend's typed load options from ``values``, defaults resolved (unknown keys refused by name)."""
    return cls.resolve_options(build_options(cls.Options, cls.name, values))


__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendOptions",
    "BackendRequest",
    "RawLogprob",
    "TokenStep",
    "backend_class",
    "options_for",
    "resolve_backend",
]
