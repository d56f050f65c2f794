"""A chat reply, finished once for every front door: stream chunks in, deltas and one outcome out.

* :class:`ChatStreamer`: stream chunks -> :class:`ChatDelta` (text with ``<tool_call>`` held back while
  tools are bound) and one :class:`ChatOutcome` (content, tool calls valid and invalid, finish reason,
  usage). A constrained reply cut short raises :class:`~exllama_integrations.errors.ConstraintViolationError`
  (or, for the HTTP server, ends with ``finish_reason="length"`` as OpenAI's API does).
* :func:`metadata`: the one mapping from a finished generation to framework metadata.

Finish reasons are reported OpenAI-style in ``finish_reason`` (``stop`` for an end-of-sequence token, a
stop string or a stop id; ``length``; ``tool_calls``; ``cancelled``) and as the runtime named them in
``native_finish_reason`` (``eos``, ``stop``, ``length``, ``cancelled``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConstraintViolationError
from .api import GenerationResult, StreamChunk, Timings, TokenLogprob, Usage
from .chat import TOOL_CLOSE, TOOL_OPEN, PreparedChat
from .streaming import StopStringMatcher

if TYPE_CHECKING:
    from .api import Runtime
    from .settings import GenerationSettings

_CALL_RE = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE) + r"|$)", re.S)
_OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}


@dataclass(frozen=True)
class ParsedToolCall:
    """A tool call found in model output; ``error`` is set when it could not be parsed (an invalid call)."""

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None


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


# --------------------------------------------------------------------------- metadata


def logprobs_content(lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Logprobs in OpenAI's chat shape: ``[{"token", "logprob", "top_logprobs": [{"token", "logprob"}]}]``."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top],
        }
        for lp in lps
    ]


def metadata(
    final: StreamChunk | GenerationResult,
    *,
    model_name: str,
    backend: str,
    finish_reason: str | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """The one mapping from a finished generation to framework metadata (same keys in every adapter).

    ``usage`` (prompt/completion/total tokens), OpenAI-style ``finish_reason`` (or the one given, e.g.
    ``tool_calls``), ``native_finish_reason``, timings, and ``logprobs`` in OpenAI's chat shape when given.
    """
    assert final.finish_reason is not None and final.usage is not None and final.timings is not None
    d: dict[str, Any] = {
        "model_name": model_name,
        "backend": backend,
        "finish_reason": finish_reason or _OPENAI_FINISH[final.finish_reason],
        "native_finish_reason": final.finish_reason,
        "usage": usage_dict(final.usage),
        "time_to_first_token": final.timings.time_to_first_token,
        "tokens_per_second": final.timings.tokens_per_second,
    }
    if final.stop_string is not None:
        d["stop_string"] = final.stop_string
    if final.constraint_complete is not None:
        d["constraint_complete"] = final.constraint_complete
    if logprobs is not None:
        d["logprobs"] = {"content": logprobs_content(logprobs)}
    return d


def usage_dict(usage: Usage) -> dict[str, int]:
    """Usage as ``{"prompt_tokens", "completion_tokens", "total_tokens"}``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


# --------------------------------------------------------------------------- streaming


@dataclass(frozen=True)
class ChatDelta:
    """New reply text (tool-call text held back) and its tokens' logprobs."""

    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class ChatOutcome:
    """A finished chat reply."""

    content: str
    """The reply without tool-call blocks."""
    tail: str
    """Content not yet sent in deltas (a false start of the tool tag, released at the end)."""
    tool_calls: tuple[ParsedToolCall, ...]
    finish_reason: str
    native_finish_reason: str
    usage: Usage
    timings: Timings
    metadata: dict[str, Any]
    raw: str
    """Everything the model wrote, tool-call blocks included."""
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def valid_tool_calls(self) -> list[ParsedToolCall]:
        """The calls that parsed."""
        return [c for c in self.tool_calls if c.error is None]

    @property
    def invalid_tool_calls(self) -> list[ParsedToolCall]:
        """The calls that did not parse (their raw text kept)."""
        return [c for c in self.tool_calls if c.error is not None]


class ChatStreamer:
    """Stream chunks -> :class:`ChatDelta` items and a final :class:`ChatOutcome` (framework-free)."""

    def __init__(
        self,
        prepared: PreparedChat,
        settings: GenerationSettings,
        *,
        model_name: str,
        backend: str,
        strict: bool = True,
    ) -> None:
        """``strict=False`` (the HTTP server): a constrained reply cut short ends as ``length``, like OpenAI's."""
        self.prepared, self.settings, self.strict = prepared, settings, strict
        self.model_name, self.backend = model_name, backend
        self._raw: list[str] = []
        self._shown: list[str] = []
        self._lps: list[TokenLogprob] = []
        # With tools bound, text from "<tool_call>" on is held back; the stop-string matcher holds a partial
        # tag across chunks exactly as it holds a partial stop string.
        self._tag = StopStringMatcher([TOOL_OPEN]) if prepared.tools_active else None

    def feed(self, chunk: StreamChunk) -> ChatDelta | ChatOutcome | None:
        """The delta for ``chunk`` (None when nothing is to be shown yet), or the outcome for the last one."""
        self._raw.append(chunk.text)
        if chunk.logprobs:
            self._lps.extend(chunk.logprobs)
        if chunk.finish_reason is None:
            text = chunk.text if self._tag is None else self._tag.push(chunk.text)
            if not text and not chunk.logprobs:
                return None
            self._shown.append(text)
            return ChatDelta(text, chunk.logprobs)
        return self._outcome(chunk)

    def _outcome(self, chunk: StreamChunk) -> ChatOutcome:
        assert chunk.usage is not None and chunk.timings is not None and chunk.finish_reason is not None
        raw = "".join(self._raw)
        if self.strict and self.prepared.grammar is not None and chunk.constraint_complete is False:
            raise ConstraintViolationError(
                f"the constrained output was cut at max_tokens={self.settings.max_new_tokens} before it was "
                f"complete ({raw[-80:]!r}); raise max_tokens."
            )
        content, calls = parse_tool_calls(raw) if self.prepared.tools_active else (raw, [])
        shown = "".join(self._shown)
        tail = content[len(shown) :] if content.startswith(shown) else ""
        finish = "tool_calls" if calls else None
        lps = tuple(self._lps) if self.settings.logprobs is not None else None
        md = metadata(chunk, model_name=self.model_name, backend=self.backend, finish_reason=finish)
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
        )


def _streamer(runtime: Runtime, prepared: PreparedChat, settings: GenerationSettings, strict: bool) -> ChatStreamer:
    info = runtime.model_info()
    return ChatStreamer(prepared, settings, model_name=info.name, backend=info.backend, strict=strict)


def stream_chat(
    runtime: Runtime,
    prepared: PreparedChat,
    settings: GenerationSettings,
    strict: bool = True,
    incremental: bool = True,
) -> Iterator[ChatDelta | ChatOutcome]:
    """Run a prepared chat: deltas, then the outcome last. Closing the iterator cancels the generation.

    ``incremental=False``: the caller wants the outcome only (see ``Runtime.stream``).
    """
    settings = prepared.settings_for(settings)
    streamer = _streamer(runtime, prepared, settings, strict)
    with runtime.stream(
        prepared.prompt, settings, grammar=prepared.grammar, add_special_tokens=False, incremental=incremental
    ) as s:
        for chunk in s:
            item = streamer.feed(chunk)
            if item is not None:
                yield item


async def astream_chat(
    runtime: Runtime,
    prepared: PreparedChat,
    settings: GenerationSettings,
    strict: bool = True,
    incremental: bool = True,
) -> AsyncIterator[ChatDelta | ChatOutcome]:
    """Async :func:`stream_chat`; the event loop stays free."""
    settings = prepared.settings_for(settings)
    streamer = _streamer(runtime, prepared, settings, strict)
    agen = runtime.astream(
        prepared.prompt, settings, grammar=prepared.grammar, add_special_tokens=False, incremental=incremental
    )
    try:
        async for chunk in agen:
            item = streamer.feed(chunk)
            if item is not None:
                yield item
    finally:
        await agen.aclose()  # type: ignore[attr-defined]
