"""LlamaIndex integration: an LLM, an embedding model, a reranker.

``ExLlamaLLM`` (a ``FunctionCallingLLM``), ``ExLlamaEmbedding`` and ``ExLlamaRerank`` (a node postprocessor).
"""

try:
    import llama_index.core  # noqa: F401
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    from ..errors import MissingDependencyError

    raise MissingDependencyError("llama-index-core", "llama-index", "the LlamaIndex LLM") from None

from .embeddings import ExLlamaEmbedding
from .llms import ExLlamaLLM
from .postprocessor import ExLlamaRerank

__all__ = ["ExLlamaEmbedding", "ExLlamaLLM", "ExLlamaRerank"]
