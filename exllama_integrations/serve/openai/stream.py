"""OpenAI's streams: server-sent events in OpenAI's framing, and chat completions' chunks of a streamed reply.

One ``data: {...}`` line per chunk object, ``data: [DONE]`` last (:func:`framed`, :func:`sse`); :func:`chat_events`
renders the chat layer's deltas and outcome as ``chat.completion.chunk`` objects (a forced call's arguments as
``tool_calls[].function.arguments`` deltas as they are written, any other call whole when complete).

After the first event the status is sent, so a typed error becomes an error event in the stream; the source
is closed at the end, shielded from a disconnect's cancellation, so its generation stops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from ...chat.outcome import ArgumentsDelta, ChatDelta, ChatOutcome, ParsedToolCall
from ...contract.shapes import chat_logprobs, usage_dict
from ...errors import ExLlamaIntegrationsError
from ..guard import error_body
from ..rules import check_finish
from ..state import ServeState, record
from ..streaming import framed_events
from .choices import merged, summed_usage
from .convert import tool_calls_out
from .protocol.chat import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDeltaWire,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
)
from .protocol.common import UsageWire

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def sse(obj: BaseModel | dict[str, Any]) -> bytes:
    """One SSE event."""
    if isinstance(obj, BaseModel):
        return b"data: " + obj.model_dump_json(exclude_none=False).encode() + b"\n\n"
    import json

    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def framed(
    source: AsyncIterator[T], render: Callable[[T], Iterable[bytes]], preamble: Iterable[bytes] = ()
) -> AsyncIterator[bytes]:
    """``source``'s items rendered as events (``preamble`` before the first), then ``data: [DONE]``.

    The first item is awaited before anything is yielded, outside the error handling: an error there
    reaches the endpoint, which answers with its status (:func:`~..streaming.framed_events`).
    """

    def opening(first: T) -> Iterator[bytes]:
        yield from preamble
        yield from render(first)

    return framed_events(source, render, _error_event, opening, last=DONE)


def _error_event(e: ExLlamaIntegrationsError) -> bytes:
    kind = "invalid_request_error" if type(e).status < 500 else "server_error"
    return sse(error_body(str(e), kind, param=e.param, code=getattr(e, "reason", None) or type(e).code))


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


def chat_events(
    state: ServeState, sources: list[Any], rid: str, include_usage: bool, scope_state: Any, n: int
) -> AsyncIterator[bytes]:
    """A chat reply's stream of one or more choices, usage summed once all have ended.

    Each chunk carries its choice's index.
    """

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
