"""ExLlama from LangChain and LlamaIndex: one loaded runtime, many front doors.

Importing this package imports no torch, no inference library and no framework; those load when
a backend or adapter is first used. Framework classes live in ``exllama_integrations.langchain``
and ``exllama_integrations.llama_index``.
"""

from importlib.metadata import PackageNotFoundError, version

from .contract.api import (
    GenerationRequest,
    GenerationResult,
    Grammar,
    Media,
    ModelInfo,
    Reasoning,
    Runtime,
    StreamChunk,
)
from .contract.decisions import DecisionRequest, DecisionResult
from .contract.retrieval import EmbeddingRequest, EmbeddingResult, RerankRequest, RerankResult
from .contract.settings import GenerationSettings
from .errors import (
    BackendUnavailableError,
    ChatTemplateError,
    ConstraintError,
    ConstraintViolationError,
    ContextLengthError,
    EngineUnavailableError,
    ExLlamaIntegrationsError,
    GenerationError,
    InputTooLongError,
    InvalidModelError,
    InvalidSettingsError,
    MediaError,
    MissingDependencyError,
    ModelLoadError,
    ModelNotFoundError,
    ModelUnavailableError,
    ProtocolError,
    RuntimeClosedError,
    ServerBusyError,
    ServerError,
    UnsupportedModelError,
    UnsupportedTaskError,
)
from .runtime.local import EmbeddingRuntime, ExLlamaRuntime

try:
    __version__ = version("exllama-integrations")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"


def __getattr__(name: str) -> object:
    if name == "GenerationChunk":  # renamed; kept working with a warning
        import warnings

        warnings.warn(
            "GenerationChunk was renamed StreamChunk (it clashed with LangChain's GenerationChunk).",
            DeprecationWarning,
            stacklevel=2,
        )
        return StreamChunk
    if name == "RemoteRuntime":  # imports httpx only when asked for
        from .runtime.remote import RemoteRuntime

        return RemoteRuntime
    raise AttributeError(name)


__all__ = [
    "BackendUnavailableError",
    "ChatTemplateError",
    "ConstraintError",
    "ConstraintViolationError",
    "ContextLengthError",
    "DecisionRequest",
    "DecisionResult",
    "EmbeddingRequest",
    "EmbeddingResult",
    "EmbeddingRuntime",
    "ExLlamaIntegrationsError",
    "ExLlamaRuntime",
    "EngineUnavailableError",
    "GenerationError",
    "GenerationRequest",
    "GenerationResult",
    "GenerationSettings",
    "Grammar",
    "InputTooLongError",
    "InvalidModelError",
    "InvalidSettingsError",
    "Media",
    "MediaError",
    "MissingDependencyError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelUnavailableError",
    "ModelInfo",
    "ProtocolError",
    "Reasoning",
    "RemoteRuntime",
    "RerankRequest",
    "RerankResult",
    "Runtime",
    "RuntimeClosedError",
    "ServerBusyError",
    "ServerError",
    "StreamChunk",
    "UnsupportedModelError",
    "UnsupportedTaskError",
    "__version__",
]
