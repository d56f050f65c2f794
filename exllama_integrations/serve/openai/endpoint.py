"""``POST /v1/chat/completions``: the route of the chat completions API, over the chat layer.

A body is prepared as the one chat (:func:`.convert.to_chat`), its reply answered whole (:func:`.convert.message_of`)
or streamed (:func:`.stream.chat_events`).

A reasoning model's thinking is ``reasoning_content`` on the message and on stream deltas (and vLLM's newer
``reasoning``), never in ``content``; its tokens are ``usage.completion_tokens_details.reasoning_tokens``.
Prompt tokens reused from the prefix cache are ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from ...chat.outcome import ChatOutcome, astream_chat
from ...chat.prepare import PreparedChat
from ...contract.shapes import chat_logprobs, usage_dict
from ..rules import ERRORS, check_finish, new_id
from ..state import ServeState, record, state_of
from ..streaming import start_stream, whole
from .choices import announce, per_choice, summed_usage
from .convert import message_of, to_chat
from .protocol.chat import ChatChoice, ChatCompletionRequest, ChatCompletionResponse
from .protocol.common import UsageWire
from .stream import chat_events

router = APIRouter(tags=["openai"])


def _switch(state: ServeState) -> bool:
    """Whether the chat template has a thinking switch (``enable_thinking``) that ``reasoning_effort`` sets."""
    template = state.chat_template or getattr(getattr(state.runtime, "tokenizer", None), "chat_template", None)
    return isinstance(template, str) and "enable_thinking" in template


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """A chat reply through the model's own template; ``stream: true`` for server-sent events."""
    state = state_of(request.app)
    state.admit(request.state, body.n)  # before anything is rendered, tokenized or fetched
    prepared = await state.prepare(body, to_chat, thinking_switch=_switch(state))
    rid = new_id("chatcmpl")
    choices = [dataclasses.replace(prepared, request=r) for r in per_choice(prepared.request, body.n)]
    announce(state.runtime, len(choices))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sources = [astream_chat(state.runtime, one, strict=False, incremental=True) for one in choices]
        events = chat_events(state, sources, rid, include_usage, request.state, body.n)
        return await start_stream(state, events, "text/event-stream")

    async def outcome(one: PreparedChat) -> ChatOutcome:
        last: Any = None
        async for last in astream_chat(state.runtime, one, strict=False, incremental=False):  # noqa: B007
            pass
        assert isinstance(last, ChatOutcome)
        return last

    async def outcomes() -> list[ChatOutcome]:
        return list(await asyncio.gather(*(outcome(one) for one in choices)))

    dones = await whole(state, request, outcomes)
    for i, done in enumerate(dones):
        check_finish(done.native_finish_reason)
        record(state, request.state, done.usage, done.timings, done.native_finish_reason, new_prompt=i == 0)
    out = [
        ChatChoice(index=i, message=message_of(d), logprobs=chat_logprobs(d.logprobs), finish_reason=d.finish_reason)
        for i, d in enumerate(dones)
    ]
    usage = UsageWire(**usage_dict(summed_usage([d.usage for d in dones], body.n)))
    return ChatCompletionResponse(id=rid, model=state.name, choices=out, usage=usage)
