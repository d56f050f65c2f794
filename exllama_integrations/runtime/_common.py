"""What every Runtime implementation shares: settings, tokens and templates from a local tokenizer, generate/abatch."""

from __future__ import annotations

import asyncio
import difflib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InvalidSettingsError
from .api import GenerationResult, Grammar, ModelInfo, Prompt, StreamChunk, TextStream, result_of
from .settings import GenerationSettings

if TYPE_CHECKING:
    from .tokenizer import NativeTokenizer


def check_setting_names(names: Sequence[str], what: str = "generation setting") -> None:
    """Refuse names that are not settings, naming the closest match.

    Raises:
        InvalidSettingsError: an unknown name.
    """
    known = list(GenerationSettings.model_fields)
    unknown = [n for n in names if n not in known]
    if unknown:
        hints = []
        for n in sorted(unknown):
            close = difflib.get_close_matches(n, known, n=1)
            hints.append(f"{n!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise InvalidSettingsError(f"unknown {what}(s): {', '.join(hints)}; valid ones are {', '.join(known)}.")


class RuntimeCommon(ABC):
    """Settings, and ``generate``, ``agenerate``, ``abatch`` in terms of ``stream`` / ``astream``.

    Tokens and chat prompts come from ``self.tokenizer``: every runtime holds the model's tokenizer here,
    a remote one included (loaded from the server's files).
    """

    settings: GenerationSettings
    tokenizer: NativeTokenizer

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` by the native tokenizer (``parse_special=False``: special-token text stays text)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, parse_special=parse_special)

    def count_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` by the native tokenizer (no BOS)."""
        return self.tokenizer.count(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens dropped)."""
        return self.tokenizer.decode(ids)

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render chat messages with the model's own template, or ``chat_template`` (bounded sandbox).

        Stream the result with ``add_special_tokens=False``: the template carries its own BOS.
        """
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **template_kwargs,
        )

    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    def expect(self, n: int) -> None:  # noqa: B027 - optional: only a runtime that batches on arrival acts on it
        """Say that ``n`` requests of one batch are about to arrive one by one.

        For ``asyncio.gather`` of calls or a LangChain ``abatch``: a local exllamav3 runtime waits for them, up
        to a tenth of a second, before it starts decoding, so they prefill together. Elsewhere nothing happens
        (a server batches on its side).
        """

    @abstractmethod
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

    @abstractmethod
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

    def resolve_settings(self, settings: GenerationSettings | None = None, **overrides: Any) -> GenerationSettings:
        """The runtime's defaults, then ``settings``, then ``overrides`` (None ignored).

        Raises:
            InvalidSettingsError: an unknown name, a bad value, or a setting this backend cannot honour.
        """
        check_setting_names(list(overrides))
        s = (settings or self.settings).merged(**overrides) if overrides else (settings or self.settings)
        refused = self.model_info().unsupported_settings
        default = GenerationSettings()
        for name, why in refused.items():
            if getattr(s, name) != getattr(default, name):
                raise InvalidSettingsError(why)
        return s

    def generate(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> GenerationResult:
        """Generate a whole completion (the stream, collected, read with ``incremental=False``)."""
        with self.stream(
            prompt, settings, grammar=grammar, add_special_tokens=add_special_tokens, incremental=False, **overrides
        ) as s:
            chunks = list(s)
        return s.result if s.result is not None else result_of(chunks, self.model_info().backend)

    async def agenerate(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> GenerationResult:
        """Async :meth:`generate`, not blocking the event loop."""
        chunks = [
            c
            async for c in self.astream(
                prompt, settings, grammar=grammar, add_special_tokens=add_special_tokens, incremental=False, **overrides
            )
        ]
        return result_of(chunks, self.model_info().backend)

    async def abatch(
        self,
        prompts: Sequence[Prompt],
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> list[GenerationResult]:
        """Async :meth:`batch`: every prompt at once."""
        s = self.resolve_settings(settings, **overrides)
        self.expect(len(prompts))
        return list(
            await asyncio.gather(
                *(self.agenerate(p, s, grammar=grammar, add_special_tokens=add_special_tokens) for p in prompts)
            )
        )
