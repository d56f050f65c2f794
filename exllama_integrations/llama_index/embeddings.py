"""``ExLlamaEmbedding``: LlamaIndex's ``BaseEmbedding`` over an embedding model's runtime (in process or served)."""

from __future__ import annotations

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from pydantic import Field

from .._retrieval import RetrievalConfig


class ExLlamaEmbedding(RetrievalConfig, BaseEmbedding):
    """An embedding model as LlamaIndex's ``BaseEmbedding`` (``Settings.embed_model = ExLlamaEmbedding(...)``).

    Texts (nodes) are embedded with the model's document prompt and queries with its query prompt, where it
    declares them; the async methods never block the event loop.

    Example:
        >>> from exllama_integrations.demo_embedding import embedding_model_dir
        >>> embed_model = ExLlamaEmbedding(model_dir=str(embedding_model_dir()))  # doctest: +SKIP
        >>> len(embed_model.get_query_embedding("What is the capital of France?"))  # doctest: +SKIP
        384
    """

    embed_batch_size: int = Field(default=64, gt=0, description="Texts handed to the runtime per call.")
    dimensions: int | None = Field(default=None, ge=1)
    """Cut vectors to this many dimensions (and renormalise them), where the model declares it can be."""

    @classmethod
    def class_name(cls) -> str:
        return "ExLlamaEmbedding"

    def _loaded(self) -> None:
        self.model_name = self._runtime.model_info().name

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embed([query], "query", self.dimensions)[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await self._aembed([query], "query", self.dimensions))[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._embed([text], "document", self.dimensions)[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await self._aembed([text], "document", self.dimensions))[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._embed(texts, "document", self.dimensions)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await self._aembed(texts, "document", self.dimensions)


__all__ = ["ExLlamaEmbedding"]
