"""``POST /v1/embeddings`` (OpenAI's shape) over the runtime that serves the request's model.

Admission counts each input as work; the vectors are computed off the event loop (the runtime's worker thread),
and so is the answer's JSON (2048 vectors of 1024 floats are two million numbers to write). A model that does
not embed answers a typed 400 (``unsupported_task``).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...contract.retrieval import embedder
from ..state import state_of
from ..streaming import until_disconnect
from .protocol.embeddings import EmbeddingBody, EmbeddingResponse

router = APIRouter(tags=["openai"])


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def embeddings(body: EmbeddingBody, request: Request) -> Response:
    """Vectors of the inputs, in their order (OpenAI's response, ``usage`` counted by the model's tokenizer)."""
    state = state_of(request.app)
    runtime = embedder(state.runtime_for(body.model))
    req = body.to_request()
    runtime.embedding_info().check_dimensions(req.dimensions)
    with state.in_flight(len(req.inputs)):
        result = await until_disconnect(request, runtime.aembed(req))  # a client gone stops the work
    request.state.usage = (result.prompt_tokens, 0, 0.0)
    name = body.model or state.name

    def answer() -> bytes:
        return EmbeddingResponse.of(result, name, body.encoding_format).model_dump_json().encode()

    return Response(await asyncio.to_thread(answer), media_type="application/json")


__all__ = ["router"]
