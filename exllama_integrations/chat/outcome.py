"""A chat reply, finished once for every front door: stream chunks in, deltas and one outcome out.

:class:`ChatStreamer`: stream chunks -> :class:`ChatDelta` items (answer text with ``<tool_call>`` held
back while tools are bound, and reasoning text apart) and one :class:`ChatOutcome` (content, reasoning,
tool calls valid and invalid, finish reason, usage, metadata). A constrained reply cut short raises
:class:`~exllama_integrations.errors.ConstraintViolationError` (or, for the HTTP server, ends with
``finish_reason="length"`` as OpenAI's API does). Tool calls are read from the answer only, never from the
thinking before it. Metadata and finish names are :mod:`exllama_integrations.contract.shapes`'.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..contract.api import StreamChunk, Timings, TokenLogprob, Usage
from ..contract.shapes import metadata
from ..errors import ConstraintViolationError
from ..model.detokenizer import StopStringMatcher
from .history import TOOL_CLOSE, TOOL_OPEN
from .prepare import PreparedChat, with_incremental

if TYPE_CHECKING:
    from ..contract.api import Runtime

_CALL_RE = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class ParsedToolCall:
    """A tool call found in model output; ``error`` is set when it could not be parsed (an invalid call)."""

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None

    @property
    def arguments_text(self) -> str:
        """The arguments as JSON text (a malformed call keeps what the model wrote)."""
        return self.raw if self.error else json.dumps(self.arguments, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Split model output into its text and the ``<tool_call>`` blocks in it; every call gets an id."""
    calls = []
    for raw in _CALL_RE.findall(text):
        cid = f"call_{uuid.uuid4().hex[:24]}"
        try:
            obj = json.loads(raw)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ParsedToolCall(cid, name, args, raw))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, RecursionError) as e:
            m = re.search(r'"name"\s*:\s*"([^"]+)"', raw)
            calls.append(ParsedToolCall(cid, m.group(1) if m else None, None, raw, f"{type(e).__name__}: {e}"))
    # The content is what a reader saw: the text around the calls, as written (not stripped).
    return (_CALL_RE.sub("", text) if calls else text), calls


@dataclass(frozen=True)
class ChatDelta:
    """New reply text (tool-call text held back), new reasoning text, and the tokens' logprobs."""

    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    reasoning: str = ""


@dataclass(frozen=True)
class ChatOutcome:
    """A finished chat reply."""

    content: str
    """The answer without tool-call blocks (and without the thinking)."""
    tail: str
    """Content not yet sent in deltas (a false start of the tool tag, released at the end)."""
    tool_calls: tuple[ParsedToolCall, ...]
    finish_reason: str
    native_finish_reason: str
    usage: Usage
    timings: Timings
    metadata: dict[str, Any]
    raw: str
    """Everything the model wrote after its thinking, tool-call blocks included."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    reasoning: str = ""
    """The model's thinking, apart from the answer (empty for a model that does not reason)."""
    reasoning_tail: str = ""
    """Reasoning not yet sent in deltas."""

    @property
    def invalid_tool_calls(self) -> list[ParsedToolCall]:
        """The calls that did not parse (their raw text kept)."""
        return [c for c in self.tool_calls if c.error is not None]


class ChatStreamer:
    """Stream chunks -> :class:`ChatDelta` items and a final :class:`ChatOutcome` (framework-free)."""

    def __init__(self, prepared: PreparedChat, *, model_name: str, backend: str, strict: bool = True) -> None:
        """``strict=False`` (the HTTP server): a constrained reply cut short ends as ``length``, like OpenAI's."""
        self.prepared, self.strict = prepared, strict
        self.settings = prepared.request.settings
        self.model_name, self.backend = model_name, backend
        self._raw: list[str] = []
        self._shown: list[str] = []
        self._reasoning: list[str] = []
        self._lps: list[TokenLogprob] = []
        # With tools bound, text from "<tool_call>" on is held back; the stop-string matcher holds a partial
        # tag across chunks exactly as it holds a partial stop string.
        self._tag = StopStringMatcher([TOOL_OPEN]) if prepared.tools_active else None

    def feed(self, chunk: StreamChunk) -> ChatDelta | ChatOutcome | None:
        """The delta for ``chunk`` (None when nothing is to be shown yet), or the outcome for the last one."""
        self._raw.append(chunk.text)
        self._reasoning.append(chunk.reasoning)
        if chunk.logprobs:
            self._lps.extend(chunk.logprobs)
        if chunk.finish_reason is None:
            text = chunk.text if self._tag is None else self._tag.push(chunk.text)
            if not text and not chunk.logprobs and not chunk.reasoning:
                return None
            self._shown.append(text)
            return ChatDelta(text, chunk.logprobs, chunk.reasoning)
        return self._outcome(chunk)

    def _outcome(self, chunk: StreamChunk) -> ChatOutcome:
        assert chunk.usage is not None and chunk.timings is not None and chunk.finish_reason is not None
        raw = "".join(self._raw)
        if self.strict and self.prepared.grammar is not None and chunk.constraint_complete is False:
            raise ConstraintViolationError(self._cut_message(raw, chunk))
        content, calls = parse_tool_calls(raw) if self.prepared.tools_active else (raw, [])
        shown = "".join(self._shown)
        tail = content[len(shown) :] if content.startswith(shown) else ""
        lps = tuple(self._lps) if self.settings.logprobs is not None else None
        md = metadata(chunk, model_name=self.model_name, backend=self.backend, tool_calls=bool(calls))
        return ChatOutcome(
            content=content,
            tail=tail,
            tool_calls=tuple(calls),
            finish_reason=md["finish_reason"],
            native_finish_reason=chunk.finish_reason,
            usage=chunk.usage,
            timings=chunk.timings,
            metadata=md,
            raw=raw,
            logprobs=lps,
            reasoning="".join(self._reasoning),
            reasoning_tail=chunk.reasoning,
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
