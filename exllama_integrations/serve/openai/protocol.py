"""The OpenAI wire schema, requests AND responses, as pydantic models (so the OpenAPI schema is true).

OpenAI's own fields are accepted as its clients send them (``presence_penalty``, ``frequency_penalty`` and
``logit_bias`` through every backend's sampler); those we cannot honour (``n`` > 1, ``echo``, ``best_of``)
are refused with a 400 naming the field, never ignored. Extensions use
vLLM's names where it has one (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos``, ``add_special_tokens``, ``chat_template_kwargs``, ``thinking_token_budget``) and are listed
in the README. A field that is neither is refused (a typo must not be silently dropped). A request turns
into the contract's values on the model itself (:meth:`CompletionRequest.to_request`,
:meth:`ChatCompletionRequest.to_chat`), settings resolved once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...chat.content import content_of
from ...chat.prepare import ChatRequest
from ...contract.api import GenerationRequest, Grammar, Media
from ...contract.settings import GenerationSettings, resolve_settings
from ...errors import InvalidSettingsError, MediaError
from ...model.media import MediaLimits, media_from_url


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Wire):
    """OpenAI's ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class GrammarWire(_Wire):
    """A grammar as data (our extension): ``{"kind": "json_schema"|"regex"|"lark", "source": ...}``."""

    kind: Literal["json_schema", "regex", "lark"]
    source: str | dict[str, Any]

    def to_grammar(self) -> Grammar:
        """The contract's grammar value."""
        if self.kind == "json_schema" and not isinstance(self.source, str):
            return Grammar.json_schema(self.source)
        if not isinstance(self.source, str):
            raise InvalidSettingsError(f"a {self.kind} grammar's source must be text.", param="grammar")
        return Grammar(self.kind, self.source)


def _refuse(field: str, why: str) -> InvalidSettingsError:
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
}
"""Request fields that are one generation setting each, as is (wire name: setting name)."""


class _Common(_Wire):
    model: str | None = None
    """The served model (default: the one this server serves)."""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
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
        if self.n != 1:
            raise _refuse("n", f"only n=1 is served (got {self.n}); send {self.n} requests, they are batched together.")
        values: dict[str, Any] = {setting: getattr(self, field) for field, setting in SETTING_FIELDS.items()}
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


class CompletionRequest(_Common):
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
            raise _refuse(bad, "not supported by this server.")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise _refuse("prompt", "one prompt per request; send several requests (they are batched together).")
            p = p[0]  # type: ignore[assignment]
        return GenerationRequest(
            p if isinstance(p, str) else tuple(p),  # type: ignore[arg-type]
            self.to_settings(defaults, refused, max_tokens_cap),
            grammar=self.grammar.to_grammar() if self.grammar is not None else None,
            add_special_tokens=self.add_special_tokens,
            incremental=self.stream,
        )


class FunctionCall(_Wire):
    """A tool call's function: its name and arguments (JSON text, or an object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallWire(_Wire):
    """An assistant message's tool call."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageURL(BaseModel):
    """An ``image_url`` part's reference: a ``data:image/...;base64,`` URL (http(s) only where the server allows)."""

    model_config = ConfigDict(extra="allow")

    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    """A message content part: ``text``, or ``image_url`` in a user turn for a model that takes images."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class MessageWire(_Wire):
    """A chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    """An earlier assistant turn's thinking (the template keeps or strips it)."""
    reasoning: str | None = None
    """vLLM's newer name for ``reasoning_content``."""

    def has_images(self) -> bool:
        """Whether the message has image parts (reading them may fetch, so it runs off the event loop)."""
        return isinstance(self.content, list) and any(p.type != "text" for p in self.content)

    def template_content(self, media: list[Media] | None, limits: MediaLimits) -> str | list[dict[str, Any]]:
        """The message's content: its text, or text and image parts, the images appended to ``media``.

        With ``media=None`` (a turn that is not the user's) images are refused.
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces: list[str | Media] = []
        for part in self.content:
            if part.type == "text":
                pieces.append(part.text or "")
            elif part.type == "image_url" and media is not None and part.image_url is not None:
                ref = part.image_url
                pieces.append(media_from_url(ref.url if isinstance(ref, ImageURL) else ref, limits))
            else:
                raise MediaError(
                    f"message content of type {part.type!r} is not taken here: send text parts "
                    "(and image_url parts in user turns).",
                    param="messages",
                )
        return content_of(pieces, media if media is not None else [])

    def to_template(self, media: list[Media] | None = None, limits: MediaLimits | None = None) -> dict[str, Any]:
        """The message as a template dict (Hugging Face conventions); a user turn's images go to ``media``."""
        role = "system" if self.role == "developer" else "tool" if self.role == "function" else self.role
        content = self.template_content(media if role == "user" else None, limits or MediaLimits())
        d: dict[str, Any] = {"role": role, "content": content}
        if self.name:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            d["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content or self.reasoning
        if thought and role == "assistant":
            d["reasoning_content"] = thought
        return d


class FunctionSpec(_Wire):
    """A tool's function: name, description and JSON-schema parameters."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolWire(_Wire):
    """A tool offered to the model."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[MessageWire] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolWire] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI fields that change nothing here
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    # extensions
    chat_template_kwargs: dict[str, Any] | None = None
    split_special_tokens: bool = False

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_chat(
        self,
        defaults: GenerationSettings,
        refused: Mapping[str, str],
        max_tokens_cap: int | None = None,
        chat_template: str | None = None,
        media_limits: MediaLimits | None = None,
    ) -> ChatRequest:
        """The chat call as the plain-data chat request every front door uses (images read within ``media_limits``)."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        media: list[Media] = []
        messages = [m.to_template(media, media_limits) for m in self.messages]
        return ChatRequest(
            messages=messages,
            settings=self.to_settings(defaults, refused, max_tokens_cap),
            tools=tools,
            tool_choice=self.tool_choice if tools else None,
            response_format=self.response_format,
            template_kwargs=self.chat_template_kwargs or {},
            chat_template=chat_template,
            split_special_tokens=self.split_special_tokens,
            media=media,
        )

    def has_images(self) -> bool:
        """Whether any message has image parts."""
        return any(m.has_images() for m in self.messages)


# --------------------------------------------------------------------------- responses


class UsageWire(BaseModel):
    """Token counts, with the details a reasoning model and a prefix cache add."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None


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


class ToolCallOut(BaseModel):
    """A tool call the model made (``index`` in stream deltas)."""

    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]
    index: int | None = None


class AssistantMessage(BaseModel):
    """The assistant's reply: content, its thinking apart, tool calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    """A ``chat.completion`` choice."""

    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    """``/v1/chat/completions``, not streamed."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageWire


class ChatDeltaWire(BaseModel):
    """What one stream event adds to the reply."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(BaseModel):
    """A ``chat.completion.chunk`` choice."""

    index: int = 0
    delta: ChatDeltaWire
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageWire | None = None


class ModelCard(BaseModel):
    """A model this server serves."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "exllama-integrations"
    context_length: int
    max_model_len: int
    backend: str


class ModelList(BaseModel):
    """``/v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


ALL_FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))
"""Every request field name (for "did you mean" on a misspelt one)."""
