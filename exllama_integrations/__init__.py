"""ExLlama from LangChain and LlamaIndex: one loaded runtime, many front doors.

Importing this package imports no torch, no inference library and no framework; those load when
a backend or adapter is first used. Framework classes live in ``exllama_integrations.langchain``
and ``exllama_integrations.llama_index``.
"""

from importlib.metadata import PackageNotFoundError, version

from .errors import (
    BackendUnavailableError,
    ChatTemplateError,
    ConstraintError,
    ConstraintViolationError,
    ContextLengthError,
    ExLlamaIntegrationsError,
    GenerationError,
    InvalidModelError,
    InvalidSettingsError,
    MissingDependencyError,
    ModelLoadError,
    ModelNotFoundError,
    RuntimeClosedError,
    ServerBusyError,
    ServerError,
    UnsupportedModelError,
)
from .runtime import ExLlamaRuntime, GenerationResult, GenerationSettings, Grammar, ModelInfo, Runtime, StreamChunk

try:
    __version__ = version("exllama-integrations")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"


def __getattr__(name: str) -> object:
    if name == "GenerationChunk":  # renamed; kept working with a warning
        from . import runtime

        return runtime.__getattr__(name)
    if name == "RemoteRuntime":  # imports httpx only when asked for
        from .serve.remote import RemoteRuntime

        return RemoteRuntime
    raise AttributeError(name)


__all__ = [
    "BackendUnavailableError",
    "ChatTemplateError",
    "ConstraintError",
    "ConstraintViolationError",
    "ContextLengthError",
    "ExLlamaIntegrationsError",
    "ExLlamaRuntime",
    "GenerationError",
    "GenerationResult",
    "GenerationSettings",
    "Grammar",
    "InvalidModelError",
    "InvalidSettingsError",
    "MissingDependencyError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelInfo",
    "RemoteRuntime",
    "Runtime",
    "RuntimeClosedError",
    "ServerBusyError",
    "ServerError",
    "StreamChunk",
    "UnsupportedModelError",
    "__version__",
]
