"""``POST /v1/embeddings`` (OpenAI's shape) over the runtime that serves the request's model.

Admission counts each input as work; the vectors are computed off the event loop (the runtime's worker thread).
A model that does not embed answers a typed 400 (``unsupported_task``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...contract.retrieval import embedder
from ..state import state_of
from .protocol.embeddings import EmbeddingBody, EmbeddingResponse

router = APIRouter(tags=["openai"])


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def embeddings(body: EmbeddingBody, request: Request) -> EmbeddingResponse:
    """Vectors of the inputs, in their order (OpenAI's response, ``usage`` counted by the model's tokenizer)."""
    state = state_of(request.app)
    runtime = embedder(state.runtime_for(body.model))
    req = body.to_request()
    runtime.embedding_info().check_dimensions(req.dimensions)
    with state.in_flight(len(req.inputs)):
        result = await runtime.aembed(req)
    request.state.usage = (result.prompt_tokens, 0, 0.0)
    return EmbeddingResponse.of(result, body.model or state.name, body.encoding_format)


__all__ = ["router"]
