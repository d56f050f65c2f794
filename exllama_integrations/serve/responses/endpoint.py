"""``POST /v1/responses``: a chat call prepared and finished by the chat layer, in the Responses API's shapes.

Streamed (``stream: true``) as the Responses API's events (:mod:`.events`), or whole as one response object
built by the same events, so both agree. Admission, disconnects and typed errors are the server's own
(:mod:`..streaming`, :mod:`..guard`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from ...chat.outcome import ChatOutcome, astream_chat
from ..guard import validation_response
from ..rules import ERRORS, check_finish
from ..state import record, state_of
from ..streaming import start_stream, whole
from .protocol import ALL_FIELDS, ResponseObject, ResponsesRequest, plain_errors
from .stream import ResponseEvents, framed
from .truncation import fitted


class ResponsesRoute(APIRoute):
    """A route that refuses a body not fitting its schema as every endpoint does, with "did you mean" its own fields."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The route's handler, its validation errors made typed."""
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return validation_response(plain_errors(e.errors()), ALL_FIELDS)

        return handle


router = APIRouter(tags=["responses"], route_class=ResponsesRoute)


@router.post("/v1/responses", response_model=ResponseObject, responses=ERRORS)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    """A reply through the model's own template, as a response object; ``stream: true`` for its events."""
    state = state_of(request.app)
    state.admit(request.state)  # before anything is rendered, tokenized or fetched
    prepared, dropped = await fitted(state, body)  # (truncation: "auto" drops the oldest turns over the context)
    events = ResponseEvents(ResponseObject.draft(body, state.name, dropped), logprobs=body.wants_logprobs)

    def finished(outcome: ChatOutcome) -> None:
        check_finish(outcome.native_finish_reason)
        record(state, request.state, outcome.usage, outcome.timings, outcome.native_finish_reason)

    if body.stream:
        items = astream_chat(state.runtime, prepared, strict=False, incremental=True)
        return await start_stream(state, framed(items, events, finished), "text/event-stream")

    async def outcome() -> ResponseObject:
        async for item in astream_chat(state.runtime, prepared, strict=False, incremental=False):
            if isinstance(item, ChatOutcome):
                finished(item)
            events.feed(item)
        return events.response

    return await whole(state, request, outcome)
