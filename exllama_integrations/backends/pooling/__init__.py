"""Pooling backends (embedding and rerank models), looked up by name without importing any inference library."""

from __future__ import annotations

import importlib
import logging

from ...errors import BackendUnavailableError, InvalidSettingsError, UnsupportedModelError
from ...model.directory import ModelDirectory
from ...model.pooling import PoolingConfig
from .base import Encoded, PoolingBackend, PoolingOptions, ScoringTokens, padded, pool

logger = logging.getLogger(__name__)

_BACKENDS = {
    "transformers": ("exllama_integrations.backends.pooling.transformers", "TransformersPooling"),
    "exllamav3": ("exllama_integrations.backends.exllamav3.pooling", "ExLlamaV3Pooling"),
}
_AUTO_ORDER = ("exllamav3", "transformers")
POOLING_BACKEND_NAMES = (*_BACKENDS, "auto")


def pooling_backend_class(name: str) -> type[PoolingBackend]:
    """The pooling backend class for a name (imports only our module, not the library)."""
    if name not in _BACKENDS:
        raise InvalidSettingsError(
            f"unknown backend {name!r} for an embedding or rerank model; choose one of "
            f"{', '.join(POOLING_BACKEND_NAMES)}.",
            param="backend",
        )
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def resolve_pooling_backend(name: str, model: ModelDirectory, pooling: PoolingConfig) -> type[PoolingBackend]:
    """The backend for ``name`` (``auto``: exllamav3 on CUDA for the models it runs, else transformers).

    Raises:
        MissingDependencyError / BackendUnavailableError: the named backend cannot run here.
        UnsupportedModelError: the named (or every available) backend cannot run this model for this task.
    """
    if name != "auto":
        cls = pooling_backend_class(name)
        cls.check_available()
        cls.check_model(model, pooling)
        return cls
    reasons = []
    for candidate in _AUTO_ORDER:
        cls = pooling_backend_class(candidate)
        try:
            cls.check_available()
            cls.check_model(model, pooling)
        except (ImportError, BackendUnavailableError, UnsupportedModelError) as e:
            reasons.append(f"{candidate}: {e}")
            continue
        logger.info("backend='auto' chose %s to %s with %s", candidate, pooling.task, model.name)
        return cls
    raise UnsupportedModelError(f"no installed backend can {pooling.task} with this model:\n  " + "\n  ".join(reasons))


__all__ = [
    "POOLING_BACKEND_NAMES",
    "Encoded",
    "PoolingBackend",
    "PoolingOptions",
    "ScoringTokens",
    "padded",
    "pool",
    "pooling_backend_class",
    "resolve_pooling_backend",
]
