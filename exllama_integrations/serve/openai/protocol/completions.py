"""``/v1/completions``' wire models: the request (a prompt, text or token ids) and the text-completion response."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from ....contract.api import GenerationRequest
from ....contract.settings import GenerationSettings
from ..choices import per_choice
from .common import CommonRequest, GrammarWire, UsageWire, refuse, texts_or_ids

MAX_PROMPTS = 64
"""Most generations one completions request may ask for (prompts in its list, times ``n``)."""


class CompletionRequest(CommonRequest):
    """``POST /v1/completions``.

    ``prompt`` is text, token ids, or a list of either (answered as one batch, a choice per prompt and ``n``, in
    that order). ``echo`` puts the prompt before the completion, and with ``logprobs`` its tokens' logprobs
    (the first token's ``null``); ``max_tokens: 0`` with ``echo`` scores the prompt and generates nothing (what
    lm-evaluation-harness's ``local-completions`` asks for).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # extensions
    add_special_tokens: bool = True
    grammar: GrammarWire | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _shape(cls, value: Any) -> Any:
        return texts_or_ids(value, "prompt", MAX_PROMPTS)

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _max_tokens(self) -> int | None:
        return 1 if self.scores_only else self.max_tokens  # the one token generated is dropped from the answer

    @property
    def scores_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt is scored, nothing is generated."""
        return self.max_tokens == 0

    def prompts(self) -> list[str | tuple[int, ...]]:
        """The prompts, each as text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        out: list[str | tuple[int, ...]] = []
        for x in p:
            if isinstance(x, int):
                return [tuple(p)]  # type: ignore[arg-type]  # one prompt of token ids
            out.append(x if isinstance(x, str) else tuple(x))
        return out

    def to_requests(
        self, defaults: GenerationSettings, refused: Mapping[str, str], max_tokens_cap: int | None = None
    ) -> list[GenerationRequest]:
        """The contract's requests for this body: one per prompt and choice, prompt by prompt.

        Raises:
            InvalidSettingsError: a field this server cannot honour, or too many generations.
        """
        if self.suffix is not None or (self.best_of or 1) > 1:
            raise refuse("suffix" if self.suffix is not None else "best_of", "not supported by this server.")
        if self.scores_only and not self.echo:
            raise refuse("max_tokens", "max_tokens 0 scores the prompt: send it with echo true (and logprobs).")
        if self.echo and self.stream:
            raise refuse("echo", "echo is answered whole here: send stream false.")
        prompts = self.prompts()
        if not prompts:
            raise refuse("prompt", "send at least one prompt.")
        if len(prompts) * self.n > MAX_PROMPTS:
            raise refuse(
                "prompt",
                f"{len(prompts)} prompts x n={self.n} is over the {MAX_PROMPTS} generations one request may ask for.",
            )
        settings = self.to_settings(defaults, refused, max_tokens_cap)
        if self.echo and self.logprobs is not None:
            settings = settings.model_copy(update={"prompt_logprobs": self.logprobs})
        grammar = self.grammar.to_grammar() if self.grammar is not None else None
        out: list[GenerationRequest] = []
        for p in prompts:
            one = GenerationRequest(
                p, settings, grammar=grammar, add_special_tokens=self.add_special_tokens, incremental=self.stream
            )
            out += per_choice(one, self.n)
        return out


class CompletionChoice(BaseModel):
    """A ``text_completion`` choice."""

    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """``/v1/completions`` (and each of its stream's events)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageWire | None = None
