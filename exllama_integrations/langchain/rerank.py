"""``ExLlamaRerank``: a LangChain document compressor that reorders documents by a reranker's relevance."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import Field

from .._retrieval import RetrievalConfig


class ExLlamaRerank(RetrievalConfig, BaseDocumentCompressor):
    """A reranker (a cross-encoder, or a Qwen3-Reranker-style yes/no model) as LangChain's document compressor.

    It keeps the ``top_n`` most relevant documents, best first, each with ``metadata["relevance_score"]`` (as
    ``CohereRerank`` does), for a ``ContextualCompressionRetriever``.

    Example:
        >>> rerank = ExLlamaRerank(model_dir="path/to/reranker", top_n=2)  # doctest: +SKIP
        >>> docs = rerank.compress_documents([Document("Paris is in France."), Document("Cats purr.")], "France")
        >>> docs[0].metadata["relevance_score"]  # doctest: +SKIP
        0.97
    """

    task: ClassVar[str] = "rerank"

    top_n: int | None = Field(default=3, ge=1)
    """How many documents to keep (None: all, reordered)."""

    def _ranked(self, documents: Sequence[Document], hits: Sequence[Any]) -> list[Document]:
        out = []
        for h in hits:
            doc = documents[h.index]
            out.append(Document(page_content=doc.page_content, metadata={**doc.metadata, "relevance_score": h.score}))
        return out

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        """The ``top_n`` documents most relevant to ``query``, best first."""
        hits = self._rerank(query, [d.page_content for d in documents], self.top_n)
        return self._ranked(documents, hits)

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        """Async :meth:`compress_documents`; the event loop stays free."""
        hits = await self._arerank(query, [d.page_content for d in documents], self.top_n)
        return self._ranked(documents, hits)


__all__ = ["ExLlamaRerank"]
