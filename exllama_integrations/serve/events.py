"""The SSE event streams of the two endpoints: OpenAI's chunk objects, ``data: [DONE]`` last.

Each stream runs to its first event before the response starts (so errors before any output get
their status), records the usage for the request's log line, and closes what it reads, shielded
from the cancellation of a disconnect, so the generation is cancelled at its next step.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

import anyio

from ..errors import ExLlamaIntegrationsError
from ..runtime.api import StreamChunk
from ..runtime.chat_outcome import ChatDelta, ChatOutcome, usage_dict
from . import convert
from .guard import error_body

T = TypeVar("T")


def sse(obj: Any) -> bytes:
    """One SSE event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def record(state: Any, usage: Any, timings: Any) -> None:
    """What the request's log line reports."""
    state.usage = (usage.prompt_tokens, usage.completion_tokens, (timings and timings.time_to_first_token) or 0.0)


async def _framed(
    source: AsyncIterator[T], render: Callable[[T], Iterable[bytes]], preamble: Iterable[bytes] = ()
) -> AsyncIterator[bytes]:
    """``source``'s items rendered as events, then ``data: [DONE]``.

    The first item is awaited before anything is sent, outside the error handling: an error there (a
    prompt over the context, bad settings) reaches the endpoint, which answers with its status. After
    the first event the status is sent, so a typed error becomes an error event in the stream. The
    source is closed at the end, shielded from a disconnect's cancellation, so its generation stops.
    """
    try:
        first = await source.__anext__()
    except StopAsyncIteration:
        yield b"data: [DONE]\n\n"
        return
    try:
        for b in preamble:
            yield b
        for b in render(first):
            yield b
        async for item in source:
            for b in render(item):
                yield b
    except ExLlamaIntegrationsError as e:
        yield sse(error_body(str(e), "server_error", code=type(e).__name__))
    finally:
        with anyio.CancelScope(shield=True):
            await source.aclose()  # type: ignore[attr-defined]
    yield b"data: [DONE]\n\n"


def completion_events(
    chunks: AsyncIterator[StreamChunk], rid: str, model: str, with_details: bool, include_usage: bool, state: Any
) -> AsyncIterator[bytes]:
    """``/v1/completions`` chunks (with our ``exllama`` details when asked), usage last when asked."""
    offset = 0

    def render(c: StreamChunk) -> Iterator[bytes]:
        nonlocal offset
        choice: dict[str, Any] = {
            "index": 0,
            "text": c.text,
            "logprobs": convert.completion_logprobs(c.logprobs, offset),
            "finish_reason": convert.finish_name(c.finish_reason) if c.finish_reason else None,
        }
        offset += len(c.text)
        if with_details:
            choice["exllama"] = convert.details(c)
        yield sse(convert.envelope("text_completion", rid, model, [choice]))
        if c.finish_reason is not None and c.usage is not None:
            record(state, c.usage, c.timings)
            if include_usage:
                yield sse(convert.envelope("text_completion", rid, model, [], usage_dict(c.usage)))

    return _framed(chunks, render)


def chat_events(
    items: AsyncIterator[ChatDelta | ChatOutcome], rid: str, model: str, include_usage: bool, state: Any
) -> AsyncIterator[bytes]:
    """``/v1/chat/completions`` chunks: the role, content deltas, tool calls, the finish, usage when asked."""

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(convert.envelope("chat.completion.chunk", rid, model, [choice]))

    def render(item: ChatDelta | ChatOutcome) -> Iterator[bytes]:
        if isinstance(item, ChatDelta):
            yield chunk({"content": item.text}, logprobs=convert.chat_logprobs(item.logprobs))
            return
        record(state, item.usage, item.timings)
        if item.tail:
            yield chunk({"content": item.tail})
        if item.tool_calls:
            yield chunk({"tool_calls": convert.tool_calls_wire(item.tool_calls, with_index=True)})
        yield chunk({}, item.finish_reason)
        if include_usage:
            yield sse(convert.envelope("chat.completion.chunk", rid, model, [], usage_dict(item.usage)))

    return _framed(items, render, preamble=[chunk({"role": "assistant", "content": ""})])
