"""LlamaIndex integration: an LLM, an embedding model, a reranker, a selector.

``ExLlamaLLM`` (a ``FunctionCallingLLM``), ``ExLlamaEmbedding``, ``ExLlamaRerank`` (a node postprocessor) and
``ExLlamaSelector`` (a ``BaseSelector`` answered from label probabilities).
"""

try:
    import llama_index.core  # noqa: F401
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    from ..errors import MissingDependencyError

    raise MissingDependencyError("llama-index-core", "llama-index", "the LlamaIndex LLM") from None

from .embeddings import ExLlamaEmbedding
from .llms import ExLlamaLLM
from .postprocessor import ExLlamaRerank
from .selectors import ExLlamaSelector

__all__ = ["ExLlamaEmbedding", "ExLlamaLLM", "ExLlamaRerank", "ExLlamaSelector"]
