"""``POST /v1/completions``: a prompt completed, streamed or whole, in OpenAI's text-completion shape."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request

from ...contract.api import GenerationResult, StreamChunk
from ...contract.shapes import completion_logprobs, finish_name, usage_dict
from ...errors import RuntimeClosedError
from ...runtime.base import acollect
from ..state import ServeState, record, state_of
from ..streaming import start_stream, whole
from .protocol.common import UsageWire
from .protocol.completions import CompletionChoice, CompletionRequest, CompletionResponse
from .sse import framed, sse

router = APIRouter(tags=["openai"])
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "a bad request (settings, context, grammar)"},
    401: {"description": "a missing or wrong API key"},
    404: {"description": "a model this server does not serve"},
    413: {"description": "a body over the server's limit"},
    503: {"description": "the server is full or its runtime was closed"},
}


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def check_finish(native: str) -> None:
    """A generation cut by the server's own runtime (closed while it ran) is an error, never a quiet "stop".

    Raises:
        RuntimeClosedError: the runtime stopped the generation.
    """
    if native == "cancelled":
        raise RuntimeClosedError("the server's runtime stopped this generation before it ended (it is shutting down).")


def _events(state: ServeState, chunks: Any, rid: str, include_usage: bool, scope_state: Any) -> Any:
    offset = 0

    def render(c: StreamChunk) -> Iterator[bytes]:
        nonlocal offset
        if c.finish_reason is not None:
            check_finish(c.finish_reason)
        choice = CompletionChoice(
            text=c.text,
            logprobs=completion_logprobs(c.logprobs, offset),
            finish_reason=finish_name(c.finish_reason) if c.finish_reason else None,
        )
        offset += len(c.text)
        yield sse(CompletionResponse(id=rid, model=state.name, choices=[choice]))
        if c.finish_reason is not None and c.usage is not None:
            record(state, scope_state, c.usage, c.timings, c.finish_reason)
            if include_usage:
                usage = UsageWire(**usage_dict(c.usage))
                yield sse(CompletionResponse(id=rid, model=state.name, choices=[], usage=usage))

    return framed(chunks, render)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request) -> Any:
    """Complete a prompt (text or token ids); ``stream: true`` for server-sent events."""
    state = state_of(request.app)
    state.check_model(body.model)
    info = state.info
    req = body.to_request(state.defaults, info.unsupported_settings, state.limits.max_tokens)
    rid = new_id("cmpl")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(state, state.runtime.aopen(req), rid, include_usage, request.state)
        return await start_stream(state, events, "text/event-stream")
    result: GenerationResult = await whole(state, request, lambda: acollect(state.runtime.aopen(req), info.backend))
    check_finish(result.finish_reason)
    record(state, request.state, result.usage, result.timings, result.finish_reason)
    lps = (result.logprobs or ()) if req.settings.logprobs is not None else None
    choice = CompletionChoice(
        text=result.text, logprobs=completion_logprobs(lps), finish_reason=finish_name(result.finish_reason)
    )
    return CompletionResponse(id=rid, model=state.name, choices=[choice], usage=UsageWire(**usage_dict(result.usage)))
