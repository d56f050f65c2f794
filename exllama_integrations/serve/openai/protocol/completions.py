"""``/v1/completions``' wire models: the request (a prompt, text or token ids) and the text-completion response."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field

from ....contract.api import GenerationRequest
from ....contract.settings import GenerationSettings
from .common import CommonRequest, GrammarWire, UsageWire, refuse


class CompletionRequest(CommonRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # extensions
    add_special_tokens: bool = True
    grammar: GrammarWire | None = None

    def _logprobs(self) -> int | None:
        return self.logprobs

    def to_request(
        self, defaults: GenerationSettings, refused: Mapping[str, str], max_tokens_cap: int | None = None
    ) -> GenerationRequest:
        """The contract's request for this body."""
        if self.echo or self.suffix is not None or (self.best_of or 1) > 1:
            bad = "echo" if self.echo else "suffix" if self.suffix is not None else "best_of"
            raise refuse(bad, "not supported by this server.")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise refuse("prompt", "one prompt per request; send several requests (they are batched together).")
            p = p[0]  # type: ignore[assignment]
        return GenerationRequest(
            p if isinstance(p, str) else tuple(p),  # type: ignore[arg-type]
            self.to_settings(defaults, refused, max_tokens_cap),
            grammar=self.grammar.to_grammar() if self.grammar is not None else None,
            add_special_tokens=self.add_special_tokens,
            incremental=self.stream,
        )


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
