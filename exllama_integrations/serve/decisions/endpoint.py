"""``POST /v1/decisions``: OpenAI's Decisions API, answered from the served model's label probabilities.

The body is checked and converted (:mod:`.convert`), admitted as one unit of work per question (each is one prompt
the model reads), and answered by the runtime's decider (:func:`~...runtime.decisions.decider`) off the event loop:
the prompts are rendered and tokenized on a worker thread, the labels scored on the backend's thread (in the
engine process under ``serve``'s default, :mod:`...runtime.engine.decisions`). A client that disconnects cancels
the scoring not started yet. A runtime that cannot answer (an embedding model's) is a typed 400, as is every bad
question; an engine that died or hung, a typed 503 like every route's.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...contract.decision_wire import answer_to_wire, metadata_to_wire, usage_to_wire
from ...runtime.decisions import decider
from ..rules import ERRORS, new_id
from ..state import state_of
from ..streaming import until_disconnect
from .convert import to_request
from .protocol import DecisionBody, DecisionResponse

router = APIRouter(tags=["decisions"])


@router.post("/v1/decisions", response_model=DecisionResponse, responses=ERRORS)
async def decisions(body: DecisionBody, request: Request) -> JSONResponse:
    """One answer per question, read from the model's probabilities over each question's labels."""
    state = state_of(request.app)
    answering = decider(state.runtime_for(body.model))
    req = to_request(body)
    with state.in_flight(len(req.questions)):
        result = await until_disconnect(request, answering.adecide(req))
    request.state.usage = (result.prompt_tokens, 0, 0.0)
    rid = new_id("decision")
    out = DecisionResponse(
        id=rid,
        model=body.model or state.name,
        answers=[answer_to_wire(a) for a in result.answers],
        usage=usage_to_wire(result),
        metadata=metadata_to_wire(req, result),
    )
    return JSONResponse(out.model_dump())


__all__ = ["router"]
