"""LangChain integrations: chat and text models, embeddings, a reranker.

``ExLlamaLLM`` (BaseLLM), ``ChatExLlama`` (BaseChatModel), ``ExLlamaEmbeddings``, ``ExLlamaRerank`` (a document
compressor) and ``ExLlamaDecisions`` (a BaseDecisionModel).
"""

try:
    import langchain_core  # noqa: F401
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    from ..errors import MissingDependencyError

    raise MissingDependencyError("langchain-core", "langchain", "the LangChain classes") from None

from .chat_models import ChatExLlama
from .decisions import ExLlamaDecisions
from .embeddings import ExLlamaEmbeddings
from .llms import ExLlamaLLM
from .rerank import ExLlamaRerank

__all__ = ["ChatExLlama", "ExLlamaDecisions", "ExLlamaEmbeddings", "ExLlamaLLM", "ExLlamaRerank"]
