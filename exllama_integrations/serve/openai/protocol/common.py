"""What every OpenAI endpoint's wire models share: the strict base, the sampling fields, usage and errors.

OpenAI's own fields are accepted as its clients send them (``presence_penalty``, ``frequency_penalty`` and
``logit_bias`` through every backend's sampler). Extensions use vLLM's names where it has one (``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``thinking_token_budget``) and are
listed in docs/serving.md. A field that is neither is refused (a typo must not be silently dropped). Settings are
resolved once, on the model itself (:meth:`CommonRequest.to_settings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import compress, count, repeat
from operator import is_not
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from ....contract.api import Grammar, check_grammar_size
from ....contract.settings import GenerationSettings, check_one_name_each, resolve_settings
from ....contract.validation import FirstErrorModel
from ....errors import InvalidSettingsError


class Wire(FirstErrorModel):
    """A request model: unknown fields refused (a typo must not be dropped), containers stop at their first bad item."""

    model_config = ConfigDict(extra="forbid")


_Wire = Wire  # the name the endpoints imported before the split


class StreamOptions(Wire):
    """OpenAI's ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None
    """OpenAI pads stream events against side channels; nothing to pad here (accepted, ignored)."""


class GrammarWire(Wire):
    """A grammar as data (our extension): ``{"kind": "json_schema"|"regex"|"lark", "source": ...}``."""

    kind: Literal["json_schema", "regex", "lark"]
    source: str | dict[str, Any]

    def to_grammar(self) -> Grammar:
        """The contract's grammar value (refused over ``MAX_GRAMMAR_CHARS``)."""
        if self.kind == "json_schema" and not isinstance(self.source, str):
            grammar = Grammar.json_schema(self.source)
        elif not isinstance(self.source, str):
            raise InvalidSettingsError(f"a {self.kind} grammar's source must be text.", param="grammar")
        else:
            grammar = Grammar(self.kind, self.source)
        check_grammar_size(grammar)
        return grammar


def refuse(field: str, why: str) -> InvalidSettingsError:
    """The typed refusal of a field this server cannot honour."""
    return InvalidSettingsError(f"{field}: {why}", param=field, reason="unsupported_parameter")


SETTING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "typical_p": "typical",
    "no_repeat_ngram_size": "no_repeat_ngram_size",
    "ignore_eos": "ignore_eos",
    "truncate_prompt": "truncate_prompt",
    "thinking_token_budget": "max_reasoning_tokens",
    "max_reasoning_tokens": "max_reasoning_tokens",
}
"""Request fields that are one generation setting each, as is (wire name: setting name)."""

MAX_CHOICES = 16
"""Most choices (``n``) one request may ask for: each is a generation of its own."""


class CommonRequest(Wire):
    """The fields both generation endpoints take (sampling, stop, streaming)."""

    model: str | None = None
    """The served model (default: the one this server serves)."""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    """Choices to generate, each sampled on its own from the same prompt (at most ``MAX_CHOICES``)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI fields that change nothing here (accepted, ignored: no server-side store, tiers or caching keys)
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    """``"in-memory"`` or ``"24h"`` (the OpenAI Agents SDK sends it); the prefix cache keeps prompts on its own."""
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    typical_p: float | None = None
    no_repeat_ngram_size: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    truncate_prompt: bool | None = None
    thinking_token_budget: int | None = Field(default=None, ge=1)
    """A reasoning model thinks for at most this many tokens, then answers (vLLM's name)."""
    max_reasoning_tokens: int | None = Field(default=None, ge=1)
    """The same budget under the library's own name (one of the two per request)."""

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def fills_context(self) -> bool:
        """Whether the request sent ``max_tokens: null`` explicitly (our extension: generate up to the context)."""
        names = ("max_tokens", "max_completion_tokens")
        sent = [n for n in names if n in self.model_fields_set]
        return bool(sent) and all(getattr(self, n, None) is None for n in sent)

    def to_settings(
        self, defaults: GenerationSettings, refused: Mapping[str, str], max_tokens_cap: int | None
    ) -> GenerationSettings:
        """The request's settings over the server's defaults, resolved once (OpenAI fields we cannot honour refused).

        ``max_tokens_cap`` (``serve --max-tokens``) caps the resolved value: a request that asks for more is
        refused; one that asks for nothing gets at most the cap.
        """
        if self.n > MAX_CHOICES:
            raise refuse("n", f"at most {MAX_CHOICES} choices per request (got {self.n}); send several requests.")
        check_one_name_each((n for n in SETTING_FIELDS if getattr(self, n) is not None), SETTING_FIELDS)
        values: dict[str, Any] = {}
        for field, setting in SETTING_FIELDS.items():
            if getattr(self, field) is not None:
                values[setting] = getattr(self, field)
        values.update(
            max_new_tokens=self._max_tokens(),
            stop_token_ids=self.stop_token_ids,
            logprobs=self._logprobs(),
            stop=[self.stop] if isinstance(self.stop, str) else self.stop,
        )
        base = defaults
        asked = self._max_tokens()
        if self.fills_context():
            if max_tokens_cap is not None:
                raise InvalidSettingsError(
                    f"max_tokens must be set (at most {max_tokens_cap}) on this server.",
                    param="max_tokens",
                    reason="max_tokens_too_large",
                )
            base = defaults.model_copy(update={"max_new_tokens": None})
        elif asked is None and max_tokens_cap is not None and (base.max_new_tokens or 0) > max_tokens_cap:
            base = defaults.model_copy(update={"max_new_tokens": max_tokens_cap})
        if asked is not None and max_tokens_cap is not None and asked > max_tokens_cap:
            raise InvalidSettingsError(
                f"max_tokens is {asked}; this server allows at most {max_tokens_cap}.",
                param="max_tokens",
                reason="max_tokens_too_large",
            )
        return resolve_settings(base, refused, **{k: v for k, v in values.items() if v is not None})


class UsageWire(BaseModel):
    """Token counts, with the details a reasoning model and a prefix cache add."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None


class ErrorBody(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


def texts_or_ids(value: Any, field: str, most: int) -> Any:
    """``value`` if it is one of the shapes ``input`` / ``prompt`` take, checked in one pass before pydantic reads it.

    A text, a list of texts, a list of token ids, or a list of token-id lists, with at most ``most`` texts or lists
    (``int``, never ``bool``, as token ids). Refused at the first item that breaks the shape its first item set, so
    a million wrong items cost one error, not one per item and per shape.

    Raises:
        PydanticCustomError: the first item that breaks the shape, or more than ``most`` items.
    """
    if not isinstance(value, list) or not value:
        return value  # a text, or not a list at all: pydantic's own error names it
    first = type(value[0])
    if first is int:
        bad = _first_not(value, int)
        if bad is not None:
            raise _shape(field, f"{field}[{bad}] is {_kind(value[bad])} in a list of token ids")
        return value
    if len(value) > most:
        raise _shape(field, f"{field} holds {len(value)} items; at most {most} go in one request (send several)")
    if first is str:
        bad = _first_not(value, str)
        if bad is not None:
            raise _shape(field, f"{field}[{bad}] is {_kind(value[bad])} in a list of texts")
        return value
    for i, item in enumerate(value):
        if type(item) is not list:
            raise _shape(field, f"{field}[{i}] is {_kind(item)}")
        bad = _first_not(item, int)
        if bad is not None:
            raise _shape(field, f"{field}[{i}][{bad}] is {_kind(item[bad])} in a list of token ids")
    return value


def _first_not(items: list[Any], kind: type) -> int | None:
    """The index of the first item whose type is not ``kind`` (``bool`` is not ``int``), at C speed, or None."""
    return next(compress(count(), map(is_not, map(type, items), repeat(kind))), None)


def _kind(v: Any) -> str:
    return {
        str: "a text",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "an object",
    }.get(type(v), "null" if v is None else type(v).__name__)


def _shape(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError(
        "invalid_shape",
        "{why}; send a text, a list of texts, a list of token ids, or a list of token-id lists",
        {"why": why, "field": field},
    )
