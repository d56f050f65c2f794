"""ExLlama from LangChain and LlamaIndex: one loaded runtime, many front doors.

Importing this package imports no torch, no inference library and no framework; those load when
a backend or adapter is first used. Framework classes live in ``exllama_integrations.langchain``
and ``exllama_integrations.llama_index``.
"""

from importlib.metadata import PackageNotFoundError, version

from .errors import (
    BackendUnavailableError,
    ConstraintError,
    ConstraintViolationError,
    ContextLengthError,
    ExLlamaIntegrationsError,
    InvalidModelError,
    InvalidSettingsError,
    MissingDependencyError,
    ModelLoadError,
    ModelNotFoundError,
    RuntimeClosedError,
    UnsupportedModelError,
)
from .runtime import ExLlamaRuntime, GenerationChunk, GenerationResult, GenerationSettings

try:
    __version__ = version("exllama-integrations")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = [
    "BackendUnavailableError",
    "ConstraintError",
    "ConstraintViolationError",
    "ContextLengthError",
    "ExLlamaIntegrationsError",
    "ExLlamaRuntime",
    "GenerationChunk",
    "GenerationResult",
    "GenerationSettings",
    "InvalidModelError",
    "InvalidSettingsError",
    "MissingDependencyError",
    "ModelLoadError",
    "ModelNotFoundError",
    "RuntimeClosedError",
    "UnsupportedModelError",
    "__version__",
]
