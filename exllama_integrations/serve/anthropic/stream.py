"""The Messages API's stream: a reply as named server-sent events, its content blocks opened and closed in order.

:func:`events` renders the chat layer's deltas and outcome: ``message_start`` (sent with the reply's first piece, its
usage split into computed and cache-read input tokens as the end's is) and a ``ping``, then each block as
``content_block_start``, its ``content_block_delta`` events (``thinking_delta``, ``text_delta``,
``input_json_delta``: a forced call's input as the model writes it, any other call's whole) and
``content_block_stop``, then ``message_delta`` (stop reason and usage) and ``message_stop``. A typed error after
the first event becomes an ``error`` event (the status was sent already); the source is closed at the end,
shielded from a disconnect's cancellation, so its generation stops.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from ...chat.outcome import ArgumentsDelta, ChatDelta, ChatOutcome
from ...errors import ExLlamaIntegrationsError
from ..rules import check_finish
from ..state import ServeState, record
from ..streaming import framed_events
from .convert import stop_of, tool_use_id, usage_out
from .errors import error_body, wire_status
from .protocol import MessageOut, MessagesRequest, UsageOut

T = TypeVar("T")


def event(name: str, data: BaseModel | dict[str, Any]) -> bytes:
    """One named SSE event; its data carries its ``type`` too, as Anthropic's do."""
    body = data.model_dump(mode="json") if isinstance(data, BaseModel) else data
    return f"event: {name}\ndata: ".encode() + json.dumps({"type": name, **body}, ensure_ascii=False).encode() + b"\n\n"


class Blocks:
    """The content blocks of one streamed reply: each opened when its first text arrives, closed before the next."""

    def __init__(self) -> None:
        """No block open yet."""
        self.index = -1
        self.open: str | None = None

    def close(self) -> Iterator[bytes]:
        """Close the open block, if one is."""
        if self.open is not None:
            yield event("content_block_stop", {"index": self.index})
            self.open = None

    def start(self, block: dict[str, Any]) -> Iterator[bytes]:
        """Close the open block and open ``block`` (its ``type`` and empty fields)."""
        yield from self.close()
        self.index += 1
        self.open = block["type"]
        yield event("content_block_start", {"index": self.index, "content_block": block})

    def thinking(self, text: str) -> Iterator[bytes]:
        """Thinking text, in a thinking block."""
        if not text:
            return
        if self.open != "thinking":
            yield from self.start({"type": "thinking", "thinking": "", "signature": ""})
        yield event("content_block_delta", {"index": self.index, "delta": {"type": "thinking_delta", "thinking": text}})

    def text(self, text: str) -> Iterator[bytes]:
        """Answer text, in a text block."""
        if not text:
            return
        if self.open != "text":
            yield from self.start({"type": "text", "text": ""})
        yield event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})

    def tool_use(self, call_id: str, name: str, arguments: str) -> Iterator[bytes]:
        """A whole tool call: its block, its input as one ``input_json_delta``, closed."""
        yield from self.start({"type": "tool_use", "id": call_id, "name": name, "input": {}})
        yield from self.input_json(arguments)
        yield from self.close()

    def input_json(self, partial: str) -> Iterator[bytes]:
        """More of the open tool_use block's input, as JSON text (a forced call's, as the model writes it)."""
        if partial:
            yield event(
                "content_block_delta",
                {"index": self.index, "delta": {"type": "input_json_delta", "partial_json": partial}},
            )

    def end(self) -> Iterator[bytes]:
        """Close the last block; a reply with none gets one empty text block, as a whole answer has."""
        if self.index < 0:
            yield from self.start({"type": "text", "text": ""})
        yield from self.close()


def framed(
    source: AsyncIterator[T], render: Callable[[T], Iterable[bytes]], preamble: Callable[[T], Iterable[bytes]]
) -> AsyncIterator[bytes]:
    """``source``'s items rendered as events after ``preamble(first)`` (the first item, which it may read).

    The first item is awaited before anything is yielded, outside the error handling: an error there reaches the
    endpoint, which answers with its status (:func:`~..streaming.framed_events`).
    """

    def opening(first: T) -> Iterator[bytes]:
        yield from preamble(first)
        yield from render(first)

    return framed_events(source, render, _error_event, opening)


def _error_event(e: ExLlamaIntegrationsError) -> bytes:
    return event("error", error_body(wire_status(type(e).status), str(e)))


def events(
    state: ServeState, items: Any, mid: str, input_tokens: int, body: MessagesRequest, scope_state: Any
) -> AsyncIterator[bytes]:
    """A streamed reply's events (see the module docstring), its outcome recorded when it ends."""
    blocks = Blocks()
    streamed: set[int] = set()  # the calls whose input streamed as it was written, by their place in the reply

    def arguments(deltas: Sequence[ArgumentsDelta]) -> Iterator[bytes]:
        for d in deltas:
            if d.first:
                streamed.add(d.index)
                yield from blocks.start({"type": "tool_use", "id": tool_use_id(d.id), "name": d.name, "input": {}})
            yield from blocks.input_json(d.delta)

    def preamble(first: ChatDelta | ChatOutcome) -> Iterator[bytes]:
        # sent once the first piece of the reply is in: by then the backend has said how much of the prompt it
        # read from its prefix cache (exllamav3 with the first token), and the opening's usage splits as the end's
        cached = first.usage.cached_tokens if isinstance(first, ChatOutcome) else first.cached_tokens
        cached = min(cached or 0, input_tokens)
        usage = UsageOut(input_tokens=input_tokens - cached, output_tokens=0, cache_read_input_tokens=cached)
        start = MessageOut(id=mid, model=state.name, content=[], usage=usage)
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


__all__ = ["Blocks", "event", "events", "framed"]
