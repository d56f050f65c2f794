"""Conveniences over the core protocol: kwargs in, a request value built once; generate, batch, async twins.

:class:`RuntimeBase` is what the package's runtimes (in process, remote) inherit: a subclass implements
the core (:meth:`open`, :meth:`aopen`, ``model_info``, tokens, templates, ``close``) and gets
``stream``/``astream``/``generate``/``agenerate``/``batch``/``abatch`` taking a prompt (or a request) with
settings and request options as keyword arguments. The functions below (:func:`collect`, :func:`run_batch`,
...) do the same over *any* core runtime, which is how the adapters use one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..contract.api import (
    Batching,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    Prompt,
    Runtime,
    StreamChunk,
    TextStream,
    result_of,
)
from ..contract.settings import GenerationSettings, check_supported, resolve_settings
from ..errors import InvalidSettingsError, MediaError

if TYPE_CHECKING:
    from ..model.tokenizer import NativeTokenizer

REQUEST_OPTIONS = tuple(f.name for f in dataclasses.fields(GenerationRequest) if f.name not in ("prompt", "settings"))
"""Keyword arguments of the conveniences that are request fields (the rest are settings)."""


def defaults_of(runtime: Runtime) -> GenerationSettings:
    """A runtime's default settings (its own, for the package's runtimes; the library's for any other)."""
    return runtime.settings if isinstance(runtime, RuntimeBase) else GenerationSettings()


def build_request(
    runtime: Runtime, prompt: Prompt | GenerationRequest, settings: GenerationSettings | None = None, **options: Any
) -> GenerationRequest:
    """A request for ``runtime``, its settings resolved here, once.

    ``options`` are request fields (``grammar``, ``add_special_tokens``, ...) or settings by any accepted name,
    applied over ``settings`` (default: the runtime's defaults).

    Raises:
        InvalidSettingsError: an unknown name (the closest match named), a bad value, or a setting the backend
            cannot honour.
    """
    fields = {k: options.pop(k) for k in REQUEST_OPTIONS if k in options}
    refused = runtime.model_info().unsupported_settings
    if isinstance(prompt, GenerationRequest):
        base = settings or prompt.settings
        s = resolve_settings(base, refused, **options) if options or settings else prompt.settings
        return dataclasses.replace(prompt, settings=s, **fields)
    s = resolve_settings(settings or defaults_of(runtime), refused, **options)
    return GenerationRequest(prompt, s, **fields)  # type: ignore[arg-type]  # checked and made a tuple there


def check_request(request: GenerationRequest, info: ModelInfo) -> None:
    """What a runtime checks of a request it is handed (settings its backend cannot honour).

    Raises:
        InvalidSettingsError: a refused setting is set.
    """
    check_supported(request.settings, info.unsupported_settings)
    bias = request.settings.logit_bias
    if bias and info.vocab_size and max(bias) >= info.vocab_size:
        raise InvalidSettingsError(
            f"logit_bias names token {max(bias)}, past this model's vocabulary ({info.vocab_size} tokens).",
            param="logit_bias",
        )


def collect(stream: TextStream, backend: str = "") -> GenerationResult:
    """Read a whole stream; its result."""
    with stream as s:
        chunks = list(s)
    return s.result if s.result is not None else result_of(chunks, backend)


async def acollect(chunks: AsyncIterator[StreamChunk], backend: str = "") -> GenerationResult:
    """Read a whole async stream; its result."""
    got = [c async for c in chunks]
    return result_of(got, backend)


def whole(request: GenerationRequest) -> GenerationRequest:
    """The request, read as a whole completion (``incremental=False``)."""
    return request if not request.incremental else dataclasses.replace(request, incremental=False)


def run_batch(runtime: Runtime, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Run requests together (one dynamic batch where the runtime batches) and return their results in order."""
    if not requests:
        return []
    backend = runtime.model_info().backend
    reqs = [whole(r) for r in requests]
    streams = runtime.open_batch(reqs) if isinstance(runtime, Batching) else [runtime.open(r) for r in reqs]
    try:
        return [collect(s, backend) for s in streams]
    finally:
        for s in streams:
            s.close()


async def arun_batch(runtime: Runtime, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Async :func:`run_batch`: every request at once, announced so that they start together."""
    if isinstance(runtime, Batching):
        runtime.expect(len(requests))
    backend = runtime.model_info().backend
    return list(await asyncio.gather(*(acollect(runtime.aopen(whole(r)), backend) for r in requests)))


class RuntimeBase(ABC):
    """The package's runtimes: the core protocol plus kwargs conveniences (see the module docstring)."""

    settings: GenerationSettings
    """Default settings of requests built by the conveniences."""

    # ----------------------------------------------------------------- the core protocol

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""

    @abstractmethod
    def model_info(self) -> ModelInfo:
        """Facts about the loaded model."""

    tokenizer: NativeTokenizer
    """The native tokenizer: token ids, text and chat prompts are computed with it, in this process."""

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` by the native tokenizer (``parse_special=False``: special-token text stays text)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, parse_special=parse_special)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens dropped)."""
        return self.tokenizer.decode(ids)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """Render chat messages with the model's own template, or ``chat_template=`` (bounded sandbox).

        ``options`` are :meth:`NativeTokenizer.apply_chat_template`'s: ``tools``, ``add_generation_prompt``,
        ``chat_template`` and the template's own variables. Generate from the result with
        ``add_special_tokens=False``: the template carries its own BOS.
        """
        return self.tokenizer.apply_chat_template(messages, **options)

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids the model reads for ``request`` (what ``usage.prompt_tokens`` will say), before it runs.

        Text is counted here by the native tokenizer; a runtime whose model takes images counts each as the
        tokens the model reads it as (in process; over HTTP, its server does).

        Raises:
            MediaError: images the model does not take, or cannot read.
        """
        if request.media:
            raise MediaError(f"{type(self).__name__} cannot count images itself.")
        prompt, add_special = self.rendered_prompt(request)
        return self.encode(prompt, add_special_tokens=add_special) if isinstance(prompt, str) else list(prompt)

    def rendered_prompt(self, request: GenerationRequest) -> tuple[str | tuple[int, ...], bool]:
        """What the model is given for ``request``, and whether special tokens are added to it.

        Messages are rendered by the chat template (no special tokens added: the template carries its own BOS);
        a prompt is given as it is.
        """
        if request.messages:
            return self.chat_prompt(request.messages), False
        return request.prompt, request.add_special_tokens

    @abstractmethod
    def open(self, request: GenerationRequest) -> TextStream:
        """Start a generation; its stream. Closing the stream cancels it."""

    @abstractmethod
    def aopen(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Async :meth:`open`: the event loop stays free. Closing the iterator cancels the generation."""

    @abstractmethod
    def close(self) -> None:
        """Release what the runtime holds. Idempotent; always returns."""

    # ----------------------------------------------------------------- conveniences

    def count_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` by the native tokenizer (no BOS)."""
        return len(self.encode(text))

    def expect(self, n: int) -> None:  # noqa: B027 - optional: only a runtime that batches on arrival acts on it
        """``n`` requests of one batch are about to arrive one by one (a local exllamav3 runtime waits for them)."""

    def open_batch(self, requests: Sequence[GenerationRequest]) -> list[TextStream]:
        """Start several generations together (one dynamic batch where the backend batches)."""
        return [self.open(r) for r in requests]

    def request(
        self, prompt: Prompt | GenerationRequest, settings: GenerationSettings | None = None, **options: Any
    ) -> GenerationRequest:
        """A request from a prompt and keyword arguments (see :func:`build_request`)."""
        return build_request(self, prompt, settings, **options)

    def stream(
        self, prompt: Prompt | GenerationRequest, settings: GenerationSettings | None = None, **options: Any
    ) -> TextStream:
        """Stream a completion of ``prompt`` (text, token ids, or a request) chunk by chunk.

        ``options``: request fields (``grammar=``, ``add_special_tokens=``, ``reasoning=``, ``incremental=``) and
        settings by name (``temperature=0``, ``stop=[...]``, ``max_tokens=``). Breaking out of the loop or closing
        the stream cancels the generation within one decoding step.
        """
        return self.open(self.request(prompt, settings, **options))

    async def astream(
        self, prompt: Prompt | GenerationRequest, settings: GenerationSettings | None = None, **options: Any
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`; the event loop stays free."""
        agen = self.aopen(self.request(prompt, settings, **options))
        try:
            async for chunk in agen:
                yield chunk
        finally:
            await agen.aclose()  # type: ignore[attr-defined]

    def generate(
        self, prompt: Prompt | GenerationRequest, settings: GenerationSettings | None = None, **options: Any
    ) -> GenerationResult:
        """Generate a whole completion (read with ``incremental=False``)."""
        return collect(self.open(whole(self.request(prompt, settings, **options))), self.model_info().backend)

    async def agenerate(
        self, prompt: Prompt | GenerationRequest, settings: GenerationSettings | None = None, **options: Any
    ) -> GenerationResult:
        """Async :meth:`generate`, not blocking the event loop."""
        request = whole(self.request(prompt, settings, **options))
        return await acollect(self.aopen(request), self.model_info().backend)

    def batch(
        self, prompts: Sequence[Prompt | GenerationRequest], settings: GenerationSettings | None = None, **options: Any
    ) -> list[GenerationResult]:
        """Completions of several prompts, handed over together (one dynamic batch). Every prompt is checked first."""
        return run_batch(self, [self.request(p, settings, **dict(options)) for p in prompts])

    async def abatch(
        self, prompts: Sequence[Prompt | GenerationRequest], settings: GenerationSettings | None = None, **options: Any
    ) -> list[GenerationResult]:
        """Async :meth:`batch`: every prompt at once."""
        return await arun_batch(self, [self.request(p, settings, **dict(options)) for p in prompts])


__all__ = [
    "REQUEST_OPTIONS",
    "RuntimeBase",
    "acollect",
    "arun_batch",
    "build_request",
    "check_request",
    "collect",
    "defaults_of",
    "run_batch",
    "whole",
]
