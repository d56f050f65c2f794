"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model, with its context length."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..state import ServeState, state_of
from .protocol.models import ModelCard, ModelList

router = APIRouter(tags=["openai"])


def card(state: ServeState) -> ModelCard:
    """The served model's card (``max_model_len`` is vLLM's name for the context length)."""
    info = state.info
    return ModelCard(
        id=state.name,
        created=state.created,
        context_length=info.context_length,
        max_model_len=info.context_length,
        backend=info.backend,
        tool_format=info.tool_format,
    )


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    """The models this server serves (one)."""
    return ModelList(data=[card(state_of(request.app))])


@router.get("/v1/models/{model_id}", response_model=ModelCard)
async def model(model_id: str, request: Request) -> ModelCard:
    """One served model's card (404 for any other)."""
    state = state_of(request.app)
    state.check_model(model_id)
    return card(state)
