"""LlamaIndex integration: ``ExLlamaLLM`` (a ``FunctionCallingLLM``)."""

try:
    import llama_index.core  # noqa: F401
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    from ..errors import MissingDependencyError

    raise MissingDependencyError("llama-index-core", "llama-index", "the LlamaIndex LLM") from None

from .llms import ExLlamaLLM

__all__ = ["ExLlamaLLM"]
