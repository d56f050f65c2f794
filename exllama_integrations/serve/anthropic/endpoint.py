"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the routes of Anthropic's Messages API.

A body is prepared as the one chat (:func:`.convert.to_chat`), its reply answered whole (:func:`.convert.message_of`)
or streamed (:func:`.stream.events`). A reasoning model's thinking is a ``thinking`` block before the answer; tool
calls are ``tool_use`` blocks after it. A forced call's input streams as the model writes it; a call cut short by
``max_tokens`` is a ``tool_use`` block with its input as far as it got and ``stop_reason: "max_tokens"``
(Anthropic's "incomplete tool use block").
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from ...chat.outcome import ChatOutcome, astream_chat
from ...chat.prepare import PreparedChat
from ...contract.api import Runtime
from ..rules import check_finish
from ..state import record, state_of
from ..streaming import start_stream, whole
from .convert import count_request, message_of, to_chat
from .errors import AnthropicRoute
from .protocol import CountTokensOut, CountTokensRequest, ErrorOut, MessageOut, MessagesRequest
from .stream import events

router = APIRouter(tags=["anthropic"], route_class=AnthropicRoute)
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "a bad request (settings, context, tools, images)"},
    401: {"model": ErrorOut, "description": "a missing or wrong API key (x-api-key or Authorization: Bearer)"},
    404: {"model": ErrorOut, "description": "a model this server does not serve"},
    413: {"model": ErrorOut, "description": "a body over the server's limit"},
    529: {"model": ErrorOut, "description": "the server is full or cannot take requests now"},
}


async def _prompt_tokens(runtime: Runtime, prepared: PreparedChat) -> int:
    """The prompt's tokens (its text encoded off the event loop; images are counted as their placeholders)."""
    prompt = prepared.prompt
    if not isinstance(prompt, str):
        return len(prompt)
    return len(await asyncio.to_thread(runtime.encode, prompt))


@router.post("/v1/messages", response_model=MessageOut, responses=ERRORS)
async def messages(body: MessagesRequest, request: Request) -> Any:
    """A reply through the model's own template; ``stream: true`` for Anthropic's server-sent events."""
    state = state_of(request.app)
    state.admit(request.state)  # before anything is rendered, tokenized or fetched
    prepared = await state.prepare(body, to_chat)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    if body.stream:
        input_tokens = await _prompt_tokens(state.runtime, prepared)
        items = astream_chat(state.runtime, prepared, strict=False, incremental=True)
        stream = events(state, items, mid, input_tokens, body, request.state)
        return await start_stream(state, stream, "text/event-stream")

    async def outcome() -> ChatOutcome:
        last: Any = None
        async for last in astream_chat(state.runtime, prepared, strict=False, incremental=False):  # noqa: B007
            pass
        assert isinstance(last, ChatOutcome)
        return last

    done = await whole(state, request, outcome)
    check_finish(done.native_finish_reason)
    record(state, request.state, done.usage, done.timings, done.native_finish_reason)
    return message_of(done, mid, state.name, body)


@router.post("/v1/messages/count_tokens", response_model=CountTokensOut, responses=ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request) -> Any:
    """The prompt's tokens for these messages, system, tools and thinking settings (nothing is generated)."""
    state = state_of(request.app)
    state.admit(request.state)  # it renders and tokenizes as a generation does
    prepared = await state.prepare(count_request(body), to_chat)
    return CountTokensOut(input_tokens=await _prompt_tokens(state.runtime, prepared))


@router.api_route("/v1/messages/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
async def not_served(rest: str) -> Any:
    """What this server does not serve under ``/v1/messages`` (batches, ...), answered in Anthropic's shape."""
    served = "POST /v1/messages and POST /v1/messages/count_tokens"
    raise HTTPException(404, f"/v1/messages/{rest} is not served here; {served} are.")


__all__ = ["router"]
