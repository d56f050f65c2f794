"""``POST /v1/rerank``, ``/rerank`` and ``/v2/rerank`` (Cohere's v1 and v2 clients, Jina's, LangChain's, TEI's paths).

The runtime that serves the request's model scores each (query, document) pair off the event loop; admission
counts each document as work. A model that does not rerank answers a typed 400 (``unsupported_task``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...contract.retrieval import reranker
from ..state import state_of
from ..streaming import until_disconnect
from .protocol import RerankBody, RerankResponse

router = APIRouter(tags=["rerank"])


@router.post("/v1/rerank", response_model=RerankResponse, response_model_exclude_none=True)
@router.post("/v2/rerank", response_model=RerankResponse, response_model_exclude_none=True)
@router.post("/rerank", response_model=RerankResponse, response_model_exclude_none=True)
async def rerank(body: RerankBody, request: Request) -> RerankResponse:
    """The documents by relevance to the query, best first (``top_n`` of them)."""
    state = state_of(request.app)
    runtime = reranker(state.runtime_for(body.model))
    req = body.to_request()
    with state.in_flight(max(1, len(req.documents))):
        result = await until_disconnect(request, runtime.arerank(req))  # a client gone stops the work
    request.state.usage = (result.prompt_tokens, 0, 0.0)
    return RerankResponse.of(result, body, body.model or state.name)


__all__ = ["router"]
