"""A chat reply, finished once for every front door: stream chunks in, deltas and one outcome out.

:class:`ChatStreamer`: stream chunks -> :class:`ChatDelta` items (answer text with ``<tool_call>`` held
back while tools are bound, and reasoning text apart) and one :class:`ChatOutcome` (content, reasoning,
tool calls valid and invalid, finish reason, usage, metadata). A forced call's arguments come as
:class:`ArgumentsDelta` items as the model writes them (the call keeps that id and text when whole); a call
``max_tokens`` cut short keeps its name and its arguments as far as they got, never its markup. A constrained
reply cut short raises :class:`~exllama_integrations.errors.ConstraintViolationError` (or, for the HTTP server,
ends with ``finish_reason="length"`` as OpenAI's API does). Tool calls are read from the answer only, never from
the thinking before it. Metadata and finish names are :mod:`exllama_integrations.contract.shapes`'.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..contract.api import StreamChunk, Timings, TokenLogprob, Usage
from ..contract.shapes import metadata
from ..errors import ConstraintViolationError
from .formats import FALLBACK, FORMATS, CallProgress, ParsedToolCall, ReplyReader, ToolFormat, new_call_id, read_reply
from .prepare import PreparedChat, with_incremental

if TYPE_CHECKING:
    from ..contract.api import Runtime

logger = logging.getLogger(__name__)


def parse_tool_calls(text: str, fmt: ToolFormat | None = None) -> tuple[str, list[ParsedToolCall]]:
    """Split finished model output into its text and its calls in ``fmt`` (default: Hermes ``<tool_call>``)."""
    return read_reply(fmt or FORMATS[FALLBACK], text)


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of a forced call's arguments, as the model writes them (JSON text; the call's deltas add up to it)."""

    index: int
    """The call's place among the reply's calls."""
    id: str
    """The id the call keeps in the outcome."""
    name: str
    delta: str
    first: bool
    """Whether this is the call's first delta (it announces the call: its id and name)."""


@dataclass(frozen=True)
class ChatDelta:
    """New reply text (tool-call markup held back), new reasoning text, logprobs, and the calls just completed.

    A call's id here is the one it keeps in the outcome.
    """

    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    reasoning: str = ""
    tool_calls: tuple[ParsedToolCall, ...] = ()
    calls_before: int = 0
    """How many calls of the reply came before these (a call's index in the reply is ``calls_before + i``)."""
    arguments: tuple[ArgumentsDelta, ...] = ()
    """A forced call's arguments as they are written, before the call is whole (and in ``tool_calls``)."""
    cached_tokens: int | None = None
    """Prompt tokens reused from the prefix cache, once the backend has said (see :class:`StreamChunk`)."""


@dataclass(frozen=True)
class ChatOutcome:
    """A finished chat reply."""

    content: str
    """The answer without tool-call blocks (and without the thinking)."""
    tail: str
    """Content not yet sent in deltas (a false start of the tool tag, released at the end)."""
    tool_calls: tuple[ParsedToolCall, ...]
    """Every call of the reply, those that did not read (``error`` set) included; see :attr:`valid_tool_calls`."""
    finish_reason: str
    native_finish_reason: str
    usage: Usage
    timings: Timings
    metadata: dict[str, Any]
    raw: str
    """Everything the model wrote after its thinking, tool-call markup included."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    reasoning: str = ""
    """The model's thinking, apart from the answer (empty for a model that does not reason)."""
    reasoning_tail: str = ""
    """Reasoning not yet sent in deltas."""

    streamed_calls: int = 0
    """How many of ``tool_calls`` were already handed out in deltas."""
    arguments: tuple[ArgumentsDelta, ...] = ()
    """The last argument deltas (the text of the last chunk), before the calls that complete with it."""

    @property
    def invalid_tool_calls(self) -> list[ParsedToolCall]:
        """The calls that did not parse (their raw text kept)."""
        return [c for c in self.tool_calls if c.error is not None]

    @property
    def valid_tool_calls(self) -> list[ParsedToolCall]:
        """The calls that read whole: what an agent runs."""
        return [c for c in self.tool_calls if c.error is None]

    @property
    def cut_tool_calls(self) -> list[ParsedToolCall]:
        """The call ``max_tokens`` cut short, if it had a name (its ``arguments_text``: as far as it got)."""
        return [c for c in self.tool_calls if c.cut and c.name]

    @property
    def invalid_text(self) -> str:
        """The raw text of the calls that did not read, for a client with no place for invalid calls.

        A call cut short is not among them: its markup never reaches the text (see :attr:`cut_tool_calls`).
        """
        return "".join(c.raw for c in self.invalid_tool_calls if not c.cut)


class ChatStreamer:
    """Stream chunks -> :class:`ChatDelta` items and a final :class:`ChatOutcome` (framework-free)."""

    def __init__(self, prepared: PreparedChat, *, model_name: str, backend: str, strict: bool = True) -> None:
        """``strict=False`` (the HTTP server): a constrained reply cut short ends as ``length``, like OpenAI's."""
        self.prepared, self.strict = prepared, strict
        self.settings = prepared.request.settings
        self.model_name, self.backend = model_name, backend
        self._raw: list[str] = []
        self._reasoning: list[str] = []
        self._lps: list[TokenLogprob] = []
        self._calls: list[ParsedToolCall] = []
        # With tools bound, the reply is read in the family's format: markup is held back (a partial tag across
        # chunks too), calls come out as they complete.
        self._reader = ReplyReader(prepared.format, prepared.tools) if prepared.tools_active else None
        # the calls followed as they are written: a forced call's arguments stream, a cut call keeps its own
        self._progress = CallProgress(prepared.format, prepared.tools) if prepared.tools_active else None
        self._ids: dict[int, str] = {}  # a streamed call's id, by its place in the reply
        self._read = 0  # calls the reader has read (those past max_tool_calls included)

    def _keep(self, calls: list[ParsedToolCall]) -> tuple[ParsedToolCall, ...]:
        """The calls to hand out (``parallel_tool_calls=False``: one; past ``max_tool_calls``, the rest ignored)."""
        out = []
        for c in calls:
            c = self._as_streamed(self._read, c)
            self._read += 1
            most = self.prepared.max_calls
            if c.error is None and most is not None and sum(k.error is None for k in self._calls) >= most:
                continue
            if c.error is None and not self.prepared.parallel and any(k.error is None for k in self._calls):
                c = ParsedToolCall(c.id, c.name, None, c.raw, "parallel_tool_calls is false: only the first call runs")
            self._calls.append(c)
            out.append(c)
        return tuple(out)

    def _arguments(self, text: str) -> tuple[ArgumentsDelta, ...]:
        """Follow the calls in ``text``; a forced reply's argument deltas (a call announced by its first one)."""
        if self._progress is None:
            return ()
        pieces = self._progress.feed(text)
        if not self.prepared.forced:
            return ()
        out: list[ArgumentsDelta] = []
        most = self.prepared.max_calls
        for index, piece in pieces:
            if most is not None and index >= most:  # a call nobody gets is never announced (the grammar stops there)
                continue
            first = index not in self._ids
            if first:
                self._ids[index] = new_call_id(self.prepared.format)
            if out and out[-1].index == index:  # one delta a call a chunk (its announcement and its first text)
                out[-1] = dataclasses.replace(out[-1], delta=out[-1].delta + piece)
            else:
                out.append(ArgumentsDelta(index, self._ids[index], self._progress.calls[index].name, piece, first))
        return tuple(out)

    def _as_streamed(self, index: int, call: ParsedToolCall) -> ParsedToolCall:
        """The reader's call with the id and argument text its stream gave it (where its arguments streamed)."""
        if index not in self._ids or call.error is not None or self._progress is None:
            return call
        written = self._progress.calls[index].arguments
        try:
            same = json.loads(written) == call.arguments
        except ValueError:
            same = False
        if not same:  # never with a forced grammar; the deltas sent stand, the call keeps the reader's text
            logger.warning("a streamed call's arguments read otherwise when whole: %r", written[:200])
            return dataclasses.replace(call, id=self._ids[index])
        return dataclasses.replace(call, id=self._ids[index], written=written)

    def _cut(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        """The last calls of a reply ``max_tokens`` cut: those the model finished, then the one it was writing.

        A region holding several calls (a pythonic or JSON list) reads as one cut call; the calls followed as they
        were written say which of them were whole. The cut one keeps its name and its arguments as far as they got,
        never its markup.
        """
        if not calls or not calls[-1].cut or self._progress is None:
            return calls
        start = self._read + len(calls) - 1
        followed = self._progress.calls[start:]
        if not followed:
            return calls
        cut = calls[-1]
        out = list(calls[:-1])
        for i, p in enumerate(followed, start):
            cid = self._ids.get(i) or new_call_id(self.prepared.format)
            if p.done:
                try:
                    written = p.arguments if i in self._ids else None  # (streamed: its text is what was sent)
                    out.append(ParsedToolCall(cid, p.name, json.loads(p.arguments), cut.raw, written=written))
                    continue
                except ValueError:
                    pass
            out.append(dataclasses.replace(cut, id=cid, name=p.name, written=p.arguments))
        return out

    def feed(self, chunk: StreamChunk) -> ChatDelta | ChatOutcome | None:
        """The delta for ``chunk`` (None when nothing is to be shown yet), or the outcome for the last one."""
        self._raw.append(chunk.text)
        self._reasoning.append(chunk.reasoning)
        if chunk.logprobs:
            self._lps.extend(chunk.logprobs)
        if chunk.finish_reason is None:
            text, calls = (chunk.text, []) if self._reader is None else self._reader.feed(chunk.text)
            arguments = self._arguments(chunk.text)
            before = len(self._calls)
            kept = self._keep(calls)
            if not text and not chunk.logprobs and not chunk.reasoning and not kept and not arguments:
                return None
            return ChatDelta(text, chunk.logprobs, chunk.reasoning, kept, before, arguments, chunk.cached_tokens)
        return self._outcome(chunk)

    def _outcome(self, chunk: StreamChunk) -> ChatOutcome:
        assert chunk.usage is not None and chunk.timings is not None and chunk.finish_reason is not None
        raw = "".join(self._raw)
        if self.strict and self.prepared.grammar is not None and chunk.constraint_complete is False:
            raise ConstraintViolationError(self._cut_message(raw, chunk))
        streamed = len(self._calls)
        arguments: tuple[ArgumentsDelta, ...] = ()
        if self._reader is None:
            tail, content = chunk.text, raw
        else:
            tail, last = self._reader.feed(chunk.text)
            arguments = self._arguments(chunk.text)
            more, final = self._reader.finish(cut=chunk.finish_reason == "length")
            tail += more
            self._keep(self._cut(last + final))
            content = "".join(self._reader.text)
        calls = tuple(self._calls)
        valid = any(c.error is None for c in calls) and chunk.finish_reason != "length"
        lps = tuple(self._lps) if self.settings.logprobs is not None else None
        md = metadata(chunk, model_name=self.model_name, backend=self.backend, tool_calls=valid)
        return ChatOutcome(
            content=content,
            tail=tail,
            tool_calls=calls,
            finish_reason=md["finish_reason"],
            native_finish_reason=chunk.finish_reason,
            usage=chunk.usage,
            timings=chunk.timings,
            metadata=md,
            raw=raw,
            logprobs=lps,
            reasoning="".join(self._reasoning),
            reasoning_tail=chunk.reasoning,
            streamed_calls=streamed,
            arguments=arguments,
        )

    def _cut_message(self, raw: str, chunk: StreamChunk) -> str:
        thinking = not raw.strip() and bool("".join(self._reasoning))
        if chunk.finish_reason == "length":
            where = "while the model was still thinking" if thinking else f"({raw[-80:]!r})"
            return (
                f"the constrained output was cut at max_tokens={self.settings.max_new_tokens} before it was complete "
                f"{where}; raise max_tokens" + (" or set max_reasoning_tokens." if thinking else ".")
            )
        return (
            f"the model ended ({chunk.finish_reason}) before its constrained output was complete ({raw[-80:]!r}); "
            "check the stop strings and stop ids, or raise max_tokens."
        )


def _streamer(runtime: Runtime, prepared: PreparedChat, strict: bool) -> ChatStreamer:
    info = runtime.model_info()
    return ChatStreamer(prepared, model_name=info.name, backend=info.backend, strict=strict)


def stream_chat(
    runtime: Runtime, prepared: PreparedChat, strict: bool = True, incremental: bool = True
) -> Iterator[ChatDelta | ChatOutcome]:
    """Run a prepared chat: deltas, then the outcome last. Closing the iterator cancels the generation.

    ``incremental=False``: the caller wants the outcome only (see ``GenerationRequest.incremental``).
    """
    streamer = _streamer(runtime, prepared, strict)
    with runtime.open(with_incremental(prepared, incremental)) as s:
        for chunk in s:
            item = streamer.feed(chunk)
            if item is not None:
                yield item


async def astream_chat(
    runtime: Runtime, prepared: PreparedChat, strict: bool = True, incremental: bool = True
) -> AsyncIterator[ChatDelta | ChatOutcome]:
    """Async :func:`stream_chat`; the event loop stays free."""
    streamer = _streamer(runtime, prepared, strict)
    agen = runtime.aopen(with_incremental(prepared, incremental))
    try:
        async for chunk in agen:
            item = streamer.feed(chunk)
            if item is not None:
                yield item
    finally:
        await agen.aclose()  # type: ignore[attr-defined]
