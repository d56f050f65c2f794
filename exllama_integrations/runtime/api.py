"""The runtime contract: what an adapter may call, and the plain values that cross it.

Adapters (LangChain, LlamaIndex, the HTTP server) are written against :class:`Runtime` only. The
in-process :class:`~exllama_integrations.ExLlamaRuntime` is one implementation, the HTTP client
:class:`~exllama_integrations.serve.remote.RemoteRuntime` another; both take and return the values
below, which hold no live objects (no tensors, no compiled grammars, no events), so they can cross
a thread, a process or a network unchanged. Cancelling is closing the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .settings import GenerationSettings

GrammarKind = Literal["json_schema", "regex", "lark"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "regex", "lark")

FinishReason = Literal["eos", "stop", "length", "cancelled"]
"""Why a generation ended: an end-of-sequence token, a stop string or stop id, ``max_new_tokens``, or the
reader stopped (closed the stream). Framework metadata reports these OpenAI-style (see runtime.chat)."""


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output, as data: the runtime compiles it against its tokenizer.

    ``json_schema``: ``source`` is a JSON schema (dict or JSON text); ``regex``: a Rust-syntax regex;
    ``lark``: a Lark grammar in llguidance's dialect (``%json {...}`` embeds a schema).

    Example:
        >>> g = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
        >>> g.kind, Grammar.from_dict(g.to_dict()) == g
        ('json_schema', True)
    """

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        from ..errors import ConstraintError

        if self.kind not in GRAMMAR_KINDS:
            raise ConstraintError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, not {self.kind!r}.")
        if not isinstance(self.source, str):
            raise ConstraintError(f"a grammar's source must be text, got {type(self.source).__name__}.")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Output must be JSON valid under ``schema`` (a dict, or its JSON text)."""
        from ..errors import ConstraintError
        from .constraints import check_depth

        if isinstance(schema, str):
            return cls("json_schema", schema)
        check_depth(schema)
        try:
            return cls("json_schema", json.dumps(schema, ensure_ascii=False, sort_keys=True))
        except (TypeError, ValueError, RecursionError) as e:
            raise ConstraintError(f"the JSON schema cannot be serialized: {type(e).__name__}: {e}") from None

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output must match ``pattern`` (Rust regex syntax: no look-around or back-references)."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Output must match a Lark grammar (llguidance dialect)."""
        return cls("lark", grammar)

    def to_dict(self) -> dict[str, str]:
        """The wire form: ``{"kind": ..., "source": ...}``."""
        return {"kind": self.kind, "source": self.source}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Grammar:
        """Read the wire form back."""
        from ..errors import ConstraintError

        if not isinstance(data, Mapping) or set(data) != {"kind", "source"}:
            raise ConstraintError('a grammar must be {"kind": "json_schema"|"regex"|"lark", "source": "..."}.')
        source = data["source"]
        if data["kind"] == "json_schema" and not isinstance(source, str):
            return cls.json_schema(source)
        return cls(data["kind"], source)


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
    """Token counts of one generation, from the native tokenizer."""

    prompt_tokens: int
    completion_tokens: int

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
    """A piece of streamed output. The last chunk of a stream carries ``finish_reason`` and ``usage``."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    stop_string: str | None = None
    constraint_complete: bool | None = None
    """On the last chunk of a constrained generation: whether the output is complete under the grammar."""

    @property
    def is_final(self) -> bool:
        """Whether this is the stream's last chunk."""
        return self.finish_reason is not None


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
    max_batch_size: int = 1
    """How many generations decode together (1: one at a time, interleaved step by step)."""
    unsupported_settings: Mapping[str, str] = field(default_factory=dict)
    """Generation settings this backend cannot honour, each with the reason (refused when set)."""
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


Prompt = str | Sequence[int]


@runtime_checkable
class Runtime(Protocol):
    """What every runtime offers. Adapters use nothing else.

    ``prompt`` is text or token ids; ``settings`` is a resolved :class:`GenerationSettings` (or None
    for the runtime's defaults) and ``overrides`` are settings by name. ``add_special_tokens=False``
    is for text rendered by :meth:`chat_prompt`, which carries its own BOS. ``incremental=False`` on
    ``stream``/``astream`` says the caller reads the whole completion (the runtime may hand it over at
    once); ``expect(n)`` announces ``n`` requests of one batch that arrive one by one.
    """

    @property
    def closed(self) -> bool: ...

    def expect(self, n: int) -> None: ...

    def model_info(self) -> ModelInfo: ...

    def resolve_settings(self, settings: GenerationSettings | None = None, **overrides: Any) -> GenerationSettings: ...

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]: ...

    def count_tokens(self, text: str) -> int: ...

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

    def stream(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        incremental: bool = True,
        **overrides: Any,
    ) -> TextStream: ...

    def astream(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        incremental: bool = True,
        **overrides: Any,
    ) -> AsyncIterator[StreamChunk]: ...

    def generate(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> GenerationResult: ...

    async def agenerate(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> GenerationResult: ...

    def batch(
        self,
        prompts: Sequence[Prompt],
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> list[GenerationResult]: ...

    async def abatch(
        self,
        prompts: Sequence[Prompt],
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> list[GenerationResult]: ...

    def close(self) -> None: ...


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
    )


__all__ = [
    "GRAMMAR_KINDS",
    "FinishReason",
    "GenerationResult",
    "Grammar",
    "ModelInfo",
    "Prompt",
    "Runtime",
    "StreamChunk",
    "TextStream",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "result_of",
]
