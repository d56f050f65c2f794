"""The Responses API's stream: a reply as its documented events, and the finished response they build.

:class:`ResponseEvents` turns the chat layer's deltas and outcome into the documented sequence:
``response.created``, ``response.in_progress``; for each output item ``response.output_item.added``, then
for a message ``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done`` (a reasoning item the same with ``reasoning_text``; a function call
``response.function_call_arguments.delta`` and ``.done``), ``response.output_item.done``; last
``response.completed`` (or ``response.incomplete``) with the whole response and its usage. Every event has a
``sequence_number``. A forced call's arguments stream as the model writes them (a delta event each); any other call
is emitted when it is complete; a call cut short by ``max_output_tokens`` is an ``incomplete`` item with its
arguments as far as they got (as OpenAI's are); a call that did not read is no call: its text goes to the answer.
The non-streamed answer is the same builder's final response, so both agree item for item.

:func:`framed` writes the events as server-sent events (``event: <type>`` and ``data: {...}``, no ``[DONE]``);
a typed error after the first event becomes an ``error`` event.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...chat.outcome import ArgumentsDelta, ChatDelta, ChatOutcome, ParsedToolCall
from ...contract.api import TokenLogprob
from ...contract.shapes import logprobs_content
from ...errors import ExLlamaIntegrationsError
from ..streaming import framed_events
from .protocol import (
    IncompleteDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputTextPart,
    ReasoningTextPart,
    ResponseObject,
    ResponseUsage,
    new_id,
)

Event = dict[str, Any]


@dataclass
class _Open:
    """The output item being written: a message or a reasoning item."""

    kind: str  # "message" | "reasoning"
    id: str
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class ResponseEvents:
    """Deltas and an outcome in, events out; :attr:`response` is the response they built."""

    def __init__(self, response: ResponseObject, logprobs: bool = False) -> None:
        """``response``: the draft (:meth:`ResponseObject.draft`), filled in as the reply arrives.

        ``logprobs``: the answer's text comes with its tokens' log-probabilities (``include``).
        """
        self.response = response
        self._logprobs = logprobs
        self._pending: list[dict[str, Any]] = []  # tokens whose text is not shown yet (markup held back)
        self._seq = 0
        self._open: _Open | None = None
        self._streamed: dict[int, int] = {}  # a streamed call's place in the reply -> its output index

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[Event]:
        """The lifecycle's first two events."""
        snapshot = self.response.wire()
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, item: ChatDelta | ChatOutcome) -> list[Event]:
        """The events for one delta, or the last ones for the outcome."""
        if isinstance(item, ChatOutcome):
            return self._finish(item)
        events = (
            self._reasoning(item.reasoning) + self._text(item.text, item.logprobs) + self._arguments(item.arguments)
        )
        for i, call in enumerate(item.tool_calls, item.calls_before):
            events += self._call(i, call)
        return events

    # ---------------------------------------------------------------- items

    def _reasoning(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = self._ensure("reasoning")
        assert self._open is not None
        self._open.text.append(delta)
        where = {"item_id": self._open.id, "output_index": self._open.index, "content_index": 0}
        return [*events, self._event("response.reasoning_text.delta", **where, delta=delta)]

    def _text(self, delta: str, logprobs: Sequence[TokenLogprob] | None = None) -> list[Event]:
        if self._logprobs and logprobs:
            self._pending += logprobs_content(logprobs)
        if not delta:
            return []
        events = self._ensure("message")
        assert self._open is not None
        self._open.text.append(delta)
        lps, self._pending = self._pending, []
        self._open.logprobs += lps
        where = {"item_id": self._open.id, "output_index": self._open.index, "content_index": 0}
        return [*events, self._event("response.output_text.delta", **where, delta=delta, logprobs=lps)]

    def _ensure(self, kind: str) -> list[Event]:
        """Open an item of ``kind`` unless one is open (closing an item of the other kind first)."""
        if self._open is not None and self._open.kind == kind:
            return []
        events = self._close("completed")
        prefix = "msg" if kind == "message" else "rs"
        self._open = _Open(kind, new_id(prefix), len(self.response.output))
        item = self._item(self._open, "in_progress")
        self.response.output.append(item)
        part = OutputTextPart(text="") if kind == "message" else ReasoningTextPart(text="")
        where = {"item_id": self._open.id, "output_index": self._open.index, "content_index": 0}
        return [
            *events,
            self._event("response.output_item.added", output_index=self._open.index, item=_empty(item)),
            self._event("response.content_part.added", **where, part=part.model_dump(mode="json")),
        ]

    def _item(self, open_: _Open, status: str) -> OutputMessage | OutputReasoning:
        text = "".join(open_.text)
        if open_.kind == "message":
            part = OutputTextPart(text=text, logprobs=open_.logprobs)
            return OutputMessage(id=open_.id, status=status, content=[part])  # type: ignore[arg-type]
        return OutputReasoning(id=open_.id, status=status, content=[ReasoningTextPart(text=text)])  # type: ignore[arg-type]

    def _close(self, status: str) -> list[Event]:
        open_, self._open = self._open, None
        if open_ is None:
            return []
        item = self._item(open_, status)
        self.response.output[open_.index] = item
        text = "".join(open_.text)
        where = {"item_id": open_.id, "output_index": open_.index, "content_index": 0}
        if isinstance(item, OutputMessage):
            done = self._event("response.output_text.done", **where, text=text, logprobs=open_.logprobs)
        else:
            done = self._event("response.reasoning_text.done", **where, text=text)
        return [
            done,
            self._event("response.content_part.done", **where, part=item.content[0].model_dump(mode="json")),
            self._event("response.output_item.done", output_index=open_.index, item=item.model_dump(mode="json")),
        ]

    def _arguments(self, deltas: Sequence[ArgumentsDelta]) -> list[Event]:
        """A forced call's arguments as they are written: its item added with the first, a delta event each."""
        events: list[Event] = []
        for d in deltas:
            if d.first:
                events += self._close("completed")
                item = OutputFunctionCall(
                    id=new_id("fc"), status="in_progress", call_id=d.id, name=d.name, arguments=""
                )
                self._streamed[d.index] = len(self.response.output)
                self.response.output.append(item)
                events.append(
                    self._event("response.output_item.added", output_index=self._streamed[d.index], item=_empty(item))
                )
            if d.delta:
                index = self._streamed[d.index]
                streamed = self.response.output[index]
                assert isinstance(streamed, OutputFunctionCall)
                streamed.arguments += d.delta
                where = {"item_id": streamed.id, "output_index": index}
                events.append(self._event("response.function_call_arguments.delta", **where, delta=d.delta))
        return events

    def _call(self, index: int, call: ParsedToolCall) -> list[Event]:
        """A call's last events: whole, or cut short by max_output_tokens (``incomplete``, its arguments so far).

        A call that did not read is no call: its text goes to the answer.
        """
        if call.name is None or (call.error is not None and not call.cut):
            return []
        status: ItemStatus = "incomplete" if call.cut else "completed"
        arguments = (call.written or "") if call.cut else call.arguments_text
        events = []
        if index in self._streamed:  # its item and its deltas went out as it was written
            at = self._streamed[index]
            item = self.response.output[at]
            assert isinstance(item, OutputFunctionCall)
            item.status, item.arguments = status, arguments
        else:
            events += self._close("completed")
            at = len(self.response.output)
            item = OutputFunctionCall(
                id=new_id("fc"), status=status, call_id=call.id, name=call.name, arguments=arguments
            )
            self.response.output.append(item)
            events += [
                self._event("response.output_item.added", output_index=at, item=_empty(item)),
                self._event(
                    "response.function_call_arguments.delta", item_id=item.id, output_index=at, delta=arguments
                ),
            ]
        where = {"item_id": item.id, "output_index": at}
        return [
            *events,
            self._event("response.function_call_arguments.done", **where, name=item.name, arguments=item.arguments),
            self._event("response.output_item.done", output_index=at, item=item.model_dump(mode="json")),
        ]

    # ---------------------------------------------------------------- the end

    def _finish(self, outcome: ChatOutcome) -> list[Event]:
        cut = outcome.finish_reason == "length"
        events = self._reasoning(outcome.reasoning_tail)
        events += self._text(outcome.tail + outcome.invalid_text) + self._arguments(outcome.arguments)
        if self._pending and self._open is not None and self._open.kind == "message":
            self._open.logprobs += self._pending  # the last tokens' text never showed (a call's markup)
        for i, call in enumerate(outcome.tool_calls[outcome.streamed_calls :], outcome.streamed_calls):
            events += self._call(i, call)
        status = "incomplete" if cut else "completed"
        if not any(isinstance(i, (OutputMessage, OutputFunctionCall)) for i in self.response.output):
            events += self._close(status)  # thinking cut by max_output_tokens is incomplete too
            events += self._ensure("message")  # an empty answer is still a message, as OpenAI's are
        events += self._close(status)
        r = self.response
        r.usage = ResponseUsage.of(outcome.usage)
        if cut:
            r.status, r.incomplete_details = "incomplete", IncompleteDetails(reason="max_output_tokens")
        else:
            r.status, r.completed_at = "completed", int(time.time())
        return [*events, self._event(f"response.{r.status}", response=r.wire())]

    def failed(self, error: ExLlamaIntegrationsError) -> Event:
        """The ``error`` event for a typed error after the stream started."""
        code = getattr(error, "reason", None) or type(error).code
        return self._event("error", code=code, message=str(error), param=error.param)


def _empty(item: OutputMessage | OutputReasoning | OutputFunctionCall) -> dict[str, Any]:
    """An item as ``response.output_item.added`` shows it: in progress, with nothing written yet."""
    data = item.model_dump(mode="json")
    data["status"] = "in_progress"
    if isinstance(item, OutputFunctionCall):
        data["arguments"] = ""
    else:
        data["content"] = []
    return data


def sse(event: Event) -> bytes:
    """One server-sent event, named by its type."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def framed(
    source: AsyncIterator[ChatDelta | ChatOutcome],
    events: ResponseEvents,
    on_outcome: Callable[[ChatOutcome], None],
) -> AsyncIterator[bytes]:
    """``source``'s items as server-sent events (see the module docstring); ``on_outcome`` sees the outcome first.

    The first item is awaited before anything is yielded, outside the error handling: an error there
    reaches the endpoint, which answers with its status. The source is closed at the end, shielded from a
    disconnect's cancellation, so its generation stops (:func:`~..streaming.framed_events`).
    """

    def render(item: ChatDelta | ChatOutcome) -> Iterable[bytes]:
        if isinstance(item, ChatOutcome):
            on_outcome(item)
        return [sse(e) for e in events.feed(item)]

    def opening(first: ChatDelta | ChatOutcome) -> list[bytes]:
        return [*(sse(e) for e in events.start()), *render(first)]

    return framed_events(source, render, lambda e: sse(events.failed(e)), opening)
