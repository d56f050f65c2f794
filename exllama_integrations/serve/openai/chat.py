"""``POST /v1/chat/completions``: a chat call prepared and finished by the chat layer, in OpenAI's chat shapes.

A reasoning model's thinking is ``reasoning_content`` on the message and on stream deltas (and vLLM's newer
``reasoning``), never in ``content``; its tokens are ``usage.completion_tokens_details.reasoning_tokens``.
Prompt tokens reused from the prefix cache are ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import APIRouter, Request

from ...chat.outcome import ArgumentsDelta, ChatDelta, ChatOutcome, ParsedToolCall, astream_chat
from ...chat.prepare import PreparedChat
from ...contract.shapes import chat_logprobs, usage_dict
from ..rules import ERRORS, check_finish, new_id
from ..state import ServeState, record, state_of
from ..streaming import start_stream, whole
from .choices import announce, merged, per_choice, summed_usage
from .protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDeltaWire,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
)
from .protocol.common import UsageWire
from .sse import framed, sse

router = APIRouter(tags=["openai"])


def tool_calls_out(
    calls: Sequence[ParsedToolCall], with_index: bool = False, first: int = 0
) -> list[ToolCallOut] | None:
    """The calls that read whole, and one ``max_tokens`` cut short, as OpenAI tool calls.

    The cut one carries its arguments as far as they got. ``first``: the index of the first among the reply's.
    """
    shown = [c for c in calls if c.error is None or (c.cut and c.name)]
    if not shown:
        return None
    return [
        ToolCallOut(
            id=c.id,
            function={"name": c.name or "", "arguments": c.arguments_text if not c.cut else c.written or ""},
            index=i if with_index else None,
        )
        for i, c in enumerate(shown, first)
    ]


def message_of(outcome: ChatOutcome) -> AssistantMessage:
    """The assistant message of a finished chat: a call that did not read is not a call, its raw text stays text.

    A call cut short by ``max_tokens`` is a call with its arguments as far as they got (``finish_reason: "length"``,
    as OpenAI's API answers it); its markup never reaches the text.
    """
    calls = tool_calls_out(outcome.tool_calls)
    thought = outcome.reasoning or None
    text = outcome.content + outcome.invalid_text
    content: str | None = text if not calls else (text or None)
    return AssistantMessage(content=content, reasoning_content=thought, reasoning=thought, tool_calls=calls)


class _Choice:
    """One choice's calls on the wire: the index each has there, those already streamed."""

    def __init__(self) -> None:
        self.sent = 0
        self.wire: dict[int, int] = {}  # a streamed call's place in the reply -> its index on the wire

    def arguments(self, deltas: Sequence[ArgumentsDelta]) -> list[ToolCallDelta]:
        """A forced call's argument deltas: the first announces it (id, name), the rest add to its arguments."""
        out: list[ToolCallDelta] = []
        for d in deltas:
            if d.first:
                self.wire[d.index] = self.sent
                self.sent += 1
                fn = FunctionDelta(name=d.name, arguments=d.delta)
                out.append(ToolCallDelta(index=self.wire[d.index], id=d.id, type="function", function=fn))
            elif out and out[-1].index == self.wire[d.index]:
                out[-1].function.arguments += d.delta
            elif d.delta:
                out.append(ToolCallDelta(index=self.wire[d.index], function=FunctionDelta(arguments=d.delta)))
        return out

    def calls(self, calls: Sequence[ParsedToolCall], before: int) -> list[ToolCallOut] | None:
        """Calls just completed that did not stream (a streamed one was sent as it came)."""
        fresh = [c for i, c in enumerate(calls, before) if i not in self.wire]
        out = tool_calls_out(fresh, with_index=True, first=self.sent)
        self.sent += len(out or ())
        return out


def _events(state: ServeState, sources: list[Any], rid: str, include_usage: bool, scope_state: Any, n: int) -> Any:
    """The stream of one or more choices (each chunk with its choice's index), usage summed once all have ended."""

    def chunk(i: int, delta: ChatDeltaWire, finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
        return sse(ChatCompletionChunk(id=rid, model=state.name, choices=[choice]))

    def delta(content: str | None, thought: str) -> ChatDeltaWire:
        return ChatDeltaWire(content=content, reasoning_content=thought or None, reasoning=thought or None)

    wires = [_Choice() for _ in sources]
    usages: dict[int, Any] = {}

    def calls(i: int, item: ChatDelta | ChatOutcome, before: int, done: Sequence[ParsedToolCall]) -> Iterator[bytes]:
        streaming = wires[i].arguments(item.arguments)
        if streaming:  # a forced call's arguments go out as they are written
            yield chunk(i, ChatDeltaWire(tool_calls=list(streaming)))
        whole = wires[i].calls(done, before)
        if whole:  # a call goes out as soon as it is complete
            yield chunk(i, ChatDeltaWire(tool_calls=list(whole)))

    def render(indexed: tuple[int, ChatDelta | ChatOutcome]) -> Iterator[bytes]:
        i, item = indexed
        if isinstance(item, ChatDelta):
            if item.text or item.reasoning or item.logprobs or not (item.tool_calls or item.arguments):
                content = item.text if item.text or not item.reasoning else None
                yield chunk(i, delta(content, item.reasoning), logprobs=chat_logprobs(item.logprobs))
            yield from calls(i, item, item.calls_before, item.tool_calls)
            invalid = "".join(c.raw for c in item.tool_calls if c.error is not None)
            if invalid:
                yield chunk(i, delta(invalid, ""))
            return
        check_finish(item.native_finish_reason)
        record(state, scope_state, item.usage, item.timings, item.native_finish_reason, new_prompt=i == 0)
        last = item.tool_calls[item.streamed_calls :]
        tail = item.tail + "".join(c.raw for c in last if c.error is not None and not c.cut)
        if tail or item.reasoning_tail:
            yield chunk(i, delta(tail or None, item.reasoning_tail))
        yield from calls(i, item, item.streamed_calls, last)
        yield chunk(i, ChatDeltaWire(), item.finish_reason)
        usages[i] = item.usage
        if include_usage and len(usages) == len(sources):
            usage = UsageWire(**usage_dict(summed_usage([usages[k] for k in range(len(sources))], n)))
            yield sse(ChatCompletionChunk(id=rid, model=state.name, choices=[], usage=usage))

    roles = [chunk(i, ChatDeltaWire(role="assistant", content="")) for i in range(len(sources))]
    return framed(merged(sources), render, preamble=roles)


def _switch(state: ServeState) -> bool:
    """Whether the chat template has a thinking switch (``enable_thinking``) that ``reasoning_effort`` sets."""
    template = state.chat_template or getattr(getattr(state.runtime, "tokenizer", None), "chat_template", None)
    return isinstance(template, str) and "enable_thinking" in template


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """A chat reply through the model's own template; ``stream: true`` for server-sent events."""
    state = state_of(request.app)
    state.admit(request.state, body.n)  # before anything is rendered, tokenized or fetched
    prepared = await state.prepare(body, _switch(state))
    rid = new_id("chatcmpl")
    choices = [dataclasses.replace(prepared, request=r) for r in per_choice(prepared.request, body.n)]
    announce(state.runtime, len(choices))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sources = [astream_chat(state.runtime, one, strict=False, incremental=True) for one in choices]
        events = _events(state, sources, rid, include_usage, request.state, body.n)
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
