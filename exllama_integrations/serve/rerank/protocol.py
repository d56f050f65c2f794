"""The rerank API's wire models: the request Cohere's clients (v1 and v2), Jina's and LangChain's send, the answer.

A request has a ``query`` and ``documents`` (texts, or ``{"text": ...}`` objects), ``top_n`` and
``return_documents`` (default true, as Jina answers; Cohere's clients read the results either way). Cohere's
``max_tokens_per_doc`` (v2) cuts each document to its first that many tokens (and a pair over the model's limit is
then cut, not refused); ``max_chunks_per_doc`` (v1) and ``priority`` (v2) are accepted
and have no effect here; ``rank_fields`` may only name ``text``. Extensions: ``truncate`` (TEI's name) and
``instruction`` (the task a yes/no reranker judges by). The answer: ``results`` of ``index`` and
``relevance_score`` (with ``document``), best first; ``usage`` (Jina's) and ``meta`` (Cohere's) with the tokens read.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, Field

from ...contract.retrieval import MAX_INPUTS, RerankRequest, RerankResult
from ...errors import InvalidSettingsError
from ..openai.protocol.common import Wire


class DocumentWire(Wire):
    """A document as an object (Cohere v1, Jina)."""

    text: str


class RerankBody(Wire):
    """A rerank request (see the module docstring)."""

    model: str | None = None
    query: str
    documents: list[str | DocumentWire] = Field(max_length=MAX_INPUTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    rank_fields: list[str] | None = None
    max_chunks_per_doc: int | None = None
    max_tokens_per_doc: int | None = Field(default=None, ge=1)
    priority: int | None = None
    truncate: bool = False
    instruction: str | None = None

    def texts(self) -> list[str]:
        """The documents' texts."""
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def to_request(self) -> RerankRequest:
        """The contract's request."""
        if self.rank_fields not in (None, ["text"]):
            raise InvalidSettingsError("rank_fields may only be ['text'] here.", param="rank_fields")
        truncate = self.truncate or self.max_tokens_per_doc is not None
        return RerankRequest(
            self.query, tuple(self.texts()), self.top_n, truncate, self.instruction, self.max_tokens_per_doc
        )


class RerankDocument(BaseModel):
    """A returned document."""

    text: str


class RerankResultWire(BaseModel):
    """One document's place."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    """The rerank answer, readable by Cohere's (v1 and v2) and Jina's clients."""

    id: str
    model: str
    results: list[RerankResultWire]
    usage: dict[str, int]
    meta: dict[str, Any]

    @classmethod
    def of(cls, result: RerankResult, body: RerankBody, model: str) -> RerankResponse:
        """The answer for a result."""
        texts = body.texts() if body.return_documents else None
        results = [
            RerankResultWire(
                index=h.index,
                relevance_score=h.score,
                document=RerankDocument(text=texts[h.index]) if texts is not None else None,
            )
            for h in result.hits
        ]
        tokens = result.prompt_tokens
        meta = {
            "api_version": {"version": "2"},
            "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": tokens},
        }
        return cls(id=uuid.uuid4().hex, model=model, results=results, usage={"total_tokens": tokens}, meta=meta)


__all__ = ["DocumentWire", "RerankBody", "RerankResponse", "RerankResultWire"]
