"""The contract: the plain values every boundary carries, and the small protocol a runtime implements.

A request is one value (:class:`GenerationRequest`); what comes back is :class:`StreamChunk` values and a
:class:`GenerationResult`; facts about the model are a :class:`ModelInfo`. None of them holds a live
object (no tensors, compiled grammars, events or file handles), so they cross a thread, a process or a
network unchanged (their JSON form is :mod:`.wire`).

:class:`Runtime` is the core protocol: ``model_info``, ``encode``/``decode``, ``chat_prompt``,
``open``/``aopen`` a request, ``close``. Conveniences (``generate``, ``batch``, kwargs) live on
:class:`~exllama_integrations.runtime.base.RuntimeBase`, and optional capabilities are protocols of their
own (:class:`Batching`, :class:`SharesTokenizer`), so a new capability never turns an existing
``runtime=`` into "not a Runtime".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import ConfigDict

from ..errors import InvalidSettingsError
from .grammar import GRAMMAR_KINDS as GRAMMAR_KINDS  # (the grammar's names, re-exported: the contract is here)
from .grammar import MAX_GRAMMAR_CHARS as MAX_GRAMMAR_CHARS
from .grammar import MAX_SCHEMA_DEPTH as MAX_SCHEMA_DEPTH
from .grammar import Grammar as Grammar
from .grammar import GrammarKind as GrammarKind
from .grammar import check_depth as check_depth
from .grammar import check_grammar_size as check_grammar_size
from .settings import GenerationSettings

FinishReason = Literal["eos", "stop", "length", "cancelled"]
"""Why a generation ended: an end-of-sequence token; a stop string or stop id; ``max_new_tokens``; or the
reader stopped (closed the stream). OpenAI's names for them are in :mod:`.shapes`."""
FINISH_REASONS: tuple[str, ...] = ("eos", "stop", "length", "cancelled")


@dataclass(frozen=True)
class Reasoning:
    """How a reasoning model's thinking is delimited in its output, and its budget.

    ``started``: the prompt already opened the block (the chat template's generation prompt ends inside it,
    as DeepSeek-R1's does), so output starts as reasoning. Otherwise output is reasoning only if it opens
    with ``start``. ``budget``: after this many reasoning tokens the runtime writes ``end`` itself. With a
    grammar, the grammar constrains only what follows ``end``.
    """

    start: str = "<think>"
    end: str = "</think>"
    started: bool = False
    budget: int | None = None

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise InvalidSettingsError("reasoning delimiters must be non-empty text, e.g. ('<think>', '</think>').")
        if self.budget is not None and self.budget < 1:
            raise InvalidSettingsError(f"a reasoning budget must be at least 1 token, not {self.budget}.")


@dataclass(frozen=True)
class Media:
    """An image (or other medium) for a model that takes one, as bytes (never a path or a live handle).

    ``placeholder`` is the text in the prompt the medium stands for; ``mime`` what the caller said it is.
    """

    data: bytes
    mime: str | None = None
    placeholder: str = ""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")
    """On the wire (:mod:`.wire`), the bytes travel as base64."""


Prompt = str | Sequence[int]


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, as a value: what every boundary carries.

    ``prompt`` is text or token ids, or ``messages`` (chat turns rendered by the runtime's template with its
    generation prompt). ``settings`` are resolved once (:func:`~.settings.resolve_settings`) and travel as
    they are. ``add_special_tokens=False`` is for text rendered by a chat template, which carries its own
    BOS. ``incremental=False`` says the reader wants the whole completion: the runtime may hand the tokens
    over when it ends instead of waking the reader per token.

    Example:
        >>> r = GenerationRequest("The sky is", GenerationSettings(max_tokens=8))
        >>> r.settings.max_new_tokens, r.add_special_tokens
        (8, True)
    """

    prompt: str | tuple[int, ...] = ""
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    grammar: Grammar | None = None
    add_special_tokens: bool = True
    reasoning: Reasoning | None = None
    media: tuple[Media, ...] = ()
    messages: tuple[Mapping[str, Any], ...] = ()
    incremental: bool = True
    show_tokens: tuple[str, ...] = ()
    """Special tokens decoded as their text in the output all the same (a model family's tool-call markup,
    such as Mistral's ``[TOOL_CALLS]`` or harmony's ``<|channel|>``); other special tokens stay hidden."""

    def __post_init__(self) -> None:
        if isinstance(self.prompt, (bytes, bytearray)):
            raise InvalidSettingsError("the prompt is bytes; decode it to str first (e.g. data.decode('utf-8')).")
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))
        if not isinstance(self.media, tuple):
            object.__setattr__(self, "media", tuple(self.media))
        if not isinstance(self.show_tokens, tuple):
            object.__setattr__(self, "show_tokens", tuple(self.show_tokens))
        if self.messages and self.prompt:
            raise InvalidSettingsError("a request has a prompt or messages, not both.")
        if not isinstance(self.settings, GenerationSettings):
            raise InvalidSettingsError(f"settings must be GenerationSettings, got {type(self.settings).__name__}.")


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token, with the top alternatives (their text included)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    """Token counts of one generation, from the native tokenizer.

    ``reasoning_tokens`` are the part of ``completion_tokens`` spent thinking; ``cached_tokens`` the part of
    ``prompt_tokens`` the backend reused from its prefix cache instead of computing (0 where it reuses none).
    ``accepted_draft_tokens`` / ``rejected_draft_tokens``: where a drafter served the request (speculative
    decoding, MTP heads), its drafted tokens the model accepted (part of ``completion_tokens``) and rejected (0 where
    nothing was drafted). The server reports them as OpenAI's ``completion_tokens_details.accepted_prediction_tokens``
    / ``rejected_prediction_tokens``.
    """

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Wall-clock timings of one generation, in seconds."""

    time_to_first_token: float | None
    total: float
    tokens_per_second: float | None
    """Decode speed: tokens after the first, over the time after the first."""


@dataclass(frozen=True)
class StreamChunk:
    """A piece of streamed output: answer ``text`` and ``reasoning`` text apart. The last chunk carries the finish.

    The last chunk of a stream has ``finish_reason``, ``usage`` and ``timings`` set.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    stop_string: str | None = None
    constraint_complete: bool | None = None
    """On the last chunk of a constrained generation: whether the output is complete under the grammar."""
    reasoning: str = ""
    """Reasoning text (a reasoning model's thinking, delimiters removed); never part of ``text``."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """On the last chunk, with ``settings.prompt_logprobs``: every prompt token as the model scores it given the
    ones before it (the first, which nothing precedes, with logprob 0.0 and no alternatives)."""
    cached_tokens: int | None = None
    """Prompt tokens reused from the backend's prefix cache, on every chunk once the backend has said (exllamav3
    says with the first token); None where it has not (the last chunk's ``usage`` says in any case)."""


@dataclass(frozen=True)
class GenerationResult:
    """A finished generation."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    stop_string: str | None = None
    backend: str = ""
    constraint_complete: bool | None = None
    """With a grammar: whether the output is complete under it (False: cut short, e.g. by max_new_tokens)."""
    reasoning: str = ""
    """The reasoning model's thinking, apart from the answer in ``text``."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """With ``settings.prompt_logprobs``: the prompt's tokens as the model scores them (see :class:`StreamChunk`)."""


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a loaded model that adapters and clients read instead of guessing."""

    name: str
    backend: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    has_chat_template: bool = False
    renders_tools: bool = False
    """Whether the chat template renders ``tools`` itself (else the documented fallback is used)."""
    tool_format: str | None = None
    """The family's tool-call format found in the chat template (a name of ``chat.formats.FORMATS``; None: not
    known, read as the Hermes ``<tool_call>`` format)."""
    max_batch_size: int = 1
    """How many generations decode together (1: one at a time, interleaved step by step)."""
    unsupported_settings: Mapping[str, str] = field(default_factory=dict)
    """Generation settings this backend cannot honour, each with the reason (refused when set)."""
    reasoning: Reasoning | None = None
    """The model's reasoning delimiters, found in its chat template or tokenizer (None: it does not reason)."""
    accepts_images: bool = False
    """Whether the model takes images (it has a vision component, loaded)."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """Backend facts (cache tokens, dtype, device, ...), for logs and metadata."""


class TextStream(Protocol):
    """A generation in progress: iterate for chunks; ``close()`` (or ``break``) cancels it within a step."""

    @property
    def result(self) -> GenerationResult | None:
        """The finished generation, once the stream is exhausted."""

    def __iter__(self) -> Iterator[StreamChunk]: ...

    def __next__(self) -> StreamChunk: ...

    def close(self) -> None: ...

    def __enter__(self) -> TextStream: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Runtime(Protocol):
    """The core protocol: what every runtime offers, and all an adapter needs.

    ``open`` starts a generation and returns its stream (typed errors about the request are raised here,
    before anything runs); ``aopen`` is the same as an async iterator that never blocks the event loop.
    Closing either cancels the generation within a step.
    """

    @property
    def closed(self) -> bool: ...

    def model_info(self) -> ModelInfo: ...

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str: ...

    def open(self, request: GenerationRequest) -> TextStream: ...

    def aopen(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]: ...

    def close(self) -> None: ...


@runtime_checkable
class Batching(Protocol):
    """Optional: a runtime that starts several requests together (one dynamic batch) when asked."""

    def open_batch(self, requests: Sequence[GenerationRequest]) -> list[TextStream]: ...

    def expect(self, n: int) -> None:
        """``n`` requests of one batch are about to arrive one by one (``asyncio.gather``): wait for them."""


@runtime_checkable
class SharesTokenizer(Protocol):
    """Optional: a runtime that can hand out its tokenizer's files (what a server shares with its clients)."""

    def tokenizer_files(self) -> dict[str, Any]: ...


def result_of(chunks: Sequence[StreamChunk], backend: str = "") -> GenerationResult:
    """A result from a whole stream's chunks (the last one final)."""
    last = chunks[-1]
    assert last.finish_reason is not None and last.usage is not None and last.timings is not None
    lps = [lp for c in chunks for lp in (c.logprobs or ())]
    return GenerationResult(
        text="".join(c.text for c in chunks),
        finish_reason=last.finish_reason,
        usage=last.usage,
        timings=last.timings,
        token_ids=tuple(t for c in chunks for t in c.token_ids),
        logprobs=tuple(lps) if any(c.logprobs is not None for c in chunks) else None,
        stop_string=last.stop_string,
        backend=backend,
        constraint_complete=last.constraint_complete,
        reasoning="".join(c.reasoning for c in chunks),
        prompt_logprobs=last.prompt_logprobs,
    )


__all__ = [
    "FINISH_REASONS",
    "GRAMMAR_KINDS",
    "Batching",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "Grammar",
    "Media",
    "ModelInfo",
    "Prompt",
    "Reasoning",
    "Runtime",
    "SharesTokenizer",
    "StreamChunk",
    "TextStream",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "check_depth",
    "result_of",
]
