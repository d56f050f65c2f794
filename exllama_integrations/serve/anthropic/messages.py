"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the chat layer's reply in Anthropic's shapes.

A reasoning model's thinking is a ``thinking`` block before the answer; tool calls are ``tool_use`` blocks after
it (:mod:`.reply` decides calls, stop reason and usage once for the whole answer and the stream). A forced call's
input streams as the model writes it; a call cut short by ``max_tokens`` is a ``tool_use`` block with its input as
far as it got and ``stop_reason: "max_tokens"`` (Anthropic's "incomplete tool use block").
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from ...chat.formats import partial_object
from ...chat.outcome import ArgumentsDelta, ChatDelta, ChatOutcome, astream_chat
from ...chat.prepare import PreparedChat
from ...contract.api import Runtime
from ..rules import check_finish
from ..state import ServeState, record, state_of
from ..streaming import start_stream, whole
from .errors import AnthropicRoute
from .protocol import (
    ContentOut,
    CountTokensOut,
    CountTokensRequest,
    ErrorOut,
    MessageOut,
    MessagesRequest,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    UsageOut,
)
from .reply import stop_of, tool_use_id, usage_out
from .sse import Blocks, event, framed

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


def _events(state: ServeState, items: Any, mid: str, input_tokens: int, body: MessagesRequest, scope_state: Any) -> Any:
    blocks = Blocks()
    streamed: set[int] = set()  # the calls whose input streamed as it was written, by their place in the reply

    def arguments(deltas: Sequence[ArgumentsDelta]) -> Iterator[bytes]:
        for d in deltas:
            if d.first:
                streamed.add(d.index)
                yield from blocks.start({"type": "tool_use", "id": tool_use_id(d.id), "name": d.name, "input": {}})
            yield from blocks.input_json(d.delta)

    def preamble() -> Iterator[bytes]:
        start = MessageOut(
            id=mid, model=state.name, content=[], usage=UsageOut(input_tokens=input_tokens, output_tokens=0)
        )
        yield event("message_start", {"message": start.model_dump(mode="json")})
        yield event("ping", {})

    def render(item: ChatDelta | ChatOutcome) -> Iterator[bytes]:
        if isinstance(item, ChatDelta):
            yield from blocks.thinking(item.reasoning)
            yield from blocks.text(item.text)
            yield from arguments(item.arguments)
            return
        check_finish(item.native_finish_reason)
        record(state, scope_state, item.usage, item.timings, item.native_finish_reason)
        calls = item.valid_tool_calls
        yield from blocks.thinking(item.reasoning_tail)
        yield from blocks.text(item.tail + item.invalid_text)
        yield from arguments(item.arguments)
        for i, c in enumerate(item.tool_calls):
            if i not in streamed and (c.error is None or c in item.cut_tool_calls):
                text = c.arguments_text if c.error is None else c.written or ""
                yield from blocks.tool_use(tool_use_id(c.id), c.name or "", text)
        yield from blocks.end()
        reason, sequence = stop_of(item, calls, body.stop_sequences or ())
        usage = usage_out(item.usage).model_dump()
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage})
        yield event("message_stop", {})

    return framed(items, render, preamble)


def message_of(outcome: ChatOutcome, mid: str, model: str, body: MessagesRequest) -> MessageOut:
    """The whole reply as Anthropic's message: thinking, text, tool_use blocks."""
    calls = outcome.valid_tool_calls
    content: list[ContentOut] = []
    if outcome.reasoning:
        content.append(ThinkingOut(thinking=outcome.reasoning))
    text = outcome.content + outcome.invalid_text
    if text:
        content.append(TextOut(text=text))
    content += [ToolUseOut(id=tool_use_id(c.id), name=c.name or "", input=c.arguments or {}) for c in calls]
    # a call max_tokens cut short: its input as far as it got (stop_reason max_tokens), never its markup
    content += [
        ToolUseOut(id=tool_use_id(c.id), name=c.name or "", input=partial_object(c.written or ""))
        for c in outcome.cut_tool_calls
    ]
    if not content:
        content.append(TextOut(text=""))
    reason, sequence = stop_of(outcome, calls, body.stop_sequences or ())
    return MessageOut(
        id=mid, model=model, content=content, stop_reason=reason, stop_sequence=sequence, usage=usage_out(outcome.usage)
    )


@router.post("/v1/messages", response_model=MessageOut, responses=ERRORS)
async def messages(body: MessagesRequest, request: Request) -> Any:
    """A reply through the model's own template; ``stream: true`` for Anthropic's server-sent events."""
    state = state_of(request.app)
    state.admit(request.state)  # before anything is rendered, tokenized or fetched
    prepared = await state.prepare(body)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    if body.stream:
        input_tokens = await _prompt_tokens(state.runtime, prepared)
        items = astream_chat(state.runtime, prepared, strict=False, incremental=True)
        events = _events(state, items, mid, input_tokens, body, request.state)
        return await start_stream(state, events, "text/event-stream")

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
    prepared = await state.prepare(body.to_messages_request())
    return CountTokensOut(input_tokens=await _prompt_tokens(state.runtime, prepared))


@router.api_route("/v1/messages/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
async def not_served(rest: str) -> Any:
    """What this server does not serve under ``/v1/messages`` (batches, ...), answered in Anthropic's shape."""
    served = "POST /v1/messages and POST /v1/messages/count_tokens"
    raise HTTPException(404, f"/v1/messages/{rest} is not served here; {served} are.")


__all__ = ["message_of", "router"]
