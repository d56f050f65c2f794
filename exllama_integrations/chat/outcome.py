"""A chat reply, finished once for every front door: stream chunks in, deltas and one outcome out.

:class:`ChatStreamer`: stream chunks -> :class:`ChatDelta` items (answer text with ``<tool_call>`` held
back while tools are bound, and reasoning text apart) and one :class:`ChatOutcome` (content, reasoning,
tool calls valid and invalid, finish reason, usage, metadata). A constrained reply cut short raises
:class:`~exllama_integrations.errors.ConstraintViolationError` (or, for the HTTP server, ends with
``finish_reason="length"`` as OpenAI's API does). Tool calls are read from the answer only, never from the
thinking before it. Metadata and finish names are :mod:`exllama_integrations.contract.shapes`'.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..contract.api import StreamChunk, Timings, TokenLogprob, Usage
from ..contract.shapes import metadata
from ..errors import ConstraintViolationError
from .formats import FALLBACK, FORMATS, ParsedToolCall, ReplyReader, ToolFormat, read_reply
from .prepare import PreparedChat, with_incremental

if TYPE_CHECKING:
    from ..contract.api import Runtime


def parse_tool_calls(text: str, fmt: ToolFormat | None = None) -> tuple[str, list[ParsedToolCall]]:
    """Split finished model output into its text and its calls in ``fmt`` (default: Hermes ``<tool_call>``)."""
    return read_reply(fmt or FORMATS[FALLBACK], text)


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

    @property
    def invalid_tool_calls(self) -> list[ParsedToolCall]:
        """The calls that did not parse (their raw text kept)."""
        return [c for c in self.tool_calls if c.error is not None]

    @property
    def valid_tool_calls(self) -> list[ParsedToolCall]:
        """The calls that read whole: what an agent runs."""
        return [c for c in self.tool_calls if c.error is None]

    @property
    def invalid_text(self) -> str:
        """The raw text of the calls that did not read, for a client with no place for invalid calls."""
        return "".join(c.raw for c in self.invalid_tool_calls)


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

    def _keep(self, calls: list[ParsedToolCall]) -> tuple[ParsedToolCall, ...]:
        """The calls to hand out (``parallel_tool_calls=False``: one; past ``max_tool_calls``, the rest ignored)."""
        out = []
        for c in calls:
            most = self.prepared.max_calls
            if c.error is None and most is not None and sum(k.error is None for k in self._calls) >= most:
                continue
            if c.error is None and not self.prepared.parallel and any(k.error is None for k in self._calls):
                c = ParsedToolCall(c.id, c.name, None, c.raw, "parallel_tool_calls is false: only the first call runs")
            self._calls.append(c)
            out.append(c)
        return tuple(out)

    def feed(self, chunk: StreamChunk) -> ChatDelta | ChatOutcome | None:
        """The delta for ``chunk`` (None when nothing is to be shown yet), or the outcome for the last one."""
        self._raw.append(chunk.text)
        self._reasoning.append(chunk.reasoning)
        if chunk.logprobs:
            self._lps.extend(chunk.logprobs)
        if chunk.finish_reason is None:
            text, calls = (chunk.text, []) if self._reader is None else self._reader.feed(chunk.text)
            before = len(self._calls)
            kept = self._keep(calls)
            if not text and not chunk.logprobs and not chunk.reasoning and not kept:
                return None
            return ChatDelta(text, chunk.logprobs, chunk.reasoning, kept, before)
        return self._outcome(chunk)

    def _outcome(self, chunk: StreamChunk) -> ChatOutcome:
        assert chunk.usage is not None and chunk.timings is not None and chunk.finish_reason is not None
        raw = "".join(self._raw)
        if self.strict and self.prepared.grammar is not None and chunk.constraint_complete is False:
            raise ConstraintViolationError(self._cut_message(raw, chunk))
        streamed = len(self._calls)
        if self._reader is None:
            tail, content = chunk.text, raw
        else:
            tail, last = self._reader.feed(chunk.text)
            more, final = self._reader.finish(cut=chunk.finish_reason == "length")
            tail += more
            self._keep(last + final)
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
