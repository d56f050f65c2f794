"""``ExLlamaRerank``: a LlamaIndex node postprocessor that reorders retrieved nodes by a reranker's relevance."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from pydantic import Field

from .._retrieval import RetrievalConfig
from ..errors import InvalidSettingsError


class ExLlamaRerank(RetrievalConfig, BaseNodePostprocessor):
    """A reranker as LlamaIndex's ``BaseNodePostprocessor`` (``node_postprocessors=[ExLlamaRerank(...)]``).

    Keeps the ``top_n`` nodes most relevant to the query, best first, each scored with its relevance.

    Example:
        >>> rerank = ExLlamaRerank(model_dir="path/to/reranker", top_n=2)  # doctest: +SKIP
        >>> engine = index.as_query_engine(similarity_top_k=8, node_postprocessors=[rerank])  # doctest: +SKIP
    """

    task: ClassVar[str] = "rerank"

    top_n: int | None = Field(default=3, ge=1)
    """How many nodes to keep (None: all, reordered)."""

    @classmethod
    def class_name(cls) -> str:
        return "ExLlamaRerank"

    @staticmethod
    def _query(query_bundle: QueryBundle | None) -> str:
        if query_bundle is None:
            raise InvalidSettingsError("reranking needs the query (a QueryBundle or query_str=).")
        return query_bundle.query_str

    @staticmethod
    def _texts(nodes: Sequence[NodeWithScore]) -> list[str]:
        return [n.node.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]

    @staticmethod
    def _ranked(nodes: Sequence[NodeWithScore], hits: Sequence[Any]) -> list[NodeWithScore]:
        return [NodeWithScore(node=nodes[h.index].node, score=h.score) for h in hits]

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        return self._ranked(nodes, self._rerank(self._query(query_bundle), self._texts(nodes), self.top_n))

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        hits = await self._arerank(self._query(query_bundle), self._texts(nodes), self.top_n)
        return self._ranked(nodes, hits)


__all__ = ["ExLlamaRerank"]
