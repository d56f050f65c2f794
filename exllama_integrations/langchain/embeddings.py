"""``ExLlamaEmbeddings``: LangChain's ``Embeddings`` over an embedding model's runtime (in process or on a server)."""

from __future__ import annotations

from typing import Any

from langchain_core.embeddings import Embeddings
from pydantic import Field

from .._retrieval import RetrievalConfig


class ExLlamaEmbeddings(RetrievalConfig, Embeddings):
    """An embedding model (sentence-transformers encoders, Qwen3-Embedding-style decoders) as LangChain ``Embeddings``.

    Documents are embedded with the model's document prompt and queries with its query prompt (where it declares
    them), in batches the runtime forms; ``dimensions`` only where the model declares Matryoshka training.

    Example:
        >>> from exllama_integrations.demo_embedding import embedding_model_dir
        >>> emb = ExLlamaEmbeddings(model_dir=str(embedding_model_dir()))  # doctest: +SKIP
        >>> len(emb.embed_query("What is the capital of France?"))  # doctest: +SKIP
        384
        >>> from langchain_core.vectorstores import InMemoryVectorStore
        >>> store = InMemoryVectorStore.from_texts(["Paris is in France."], emb)  # doctest: +SKIP
    """

    dimensions: int | None = Field(default=None, ge=1)
    """Cut vectors to this many dimensions (and renormalise them), where the model declares it can be."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Vectors of documents, in their order."""
        return self._embed(texts, "document", self.dimensions)

    def embed_query(self, text: str) -> list[float]:
        """The vector of a query."""
        return self._embed([text], "query", self.dimensions)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """Async :meth:`embed_documents`; the event loop stays free."""
        return await self._aembed(texts, "document", self.dimensions)

    async def aembed_query(self, text: str) -> list[float]:
        """Async :meth:`embed_query`; the event loop stays free."""
        return (await self._aembed([text], "query", self.dimensions))[0]

    def __repr_args__(self) -> Any:
        return [(k, v) for k, v in super().__repr_args__() if k != "api_key"]


__all__ = ["ExLlamaEmbeddings"]
