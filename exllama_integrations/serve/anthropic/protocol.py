"""Anthropic's Messages API wire schema, requests AND responses, as pydantic models (so the OpenAPI schema is true).

What each field means for the chat is :mod:`.convert`'s. Fields Anthropic documents that change nothing here
(``metadata``, ``service_tier``, ``cache_control``) are accepted; any other is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...contract.validation import FirstErrorModel


class _Wire(FirstErrorModel):
    model_config = ConfigDict(extra="forbid")


class _Block(_Wire):
    cache_control: dict[str, Any] | None = None
    """Prompt caching hint; the prefix cache reuses prompts on its own, so it changes nothing here."""


class TextBlock(_Block):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class ImageSource(_Wire):
    """An image's bytes: ``base64`` (with its ``media_type``) or a ``url`` (fetched only where the server allows)."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Block):
    """``{"type": "image", "source": {...}}``."""

    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Block):
    """A tool call the assistant made (in history, and in replies)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """A tool's answer to the call ``tool_use_id``: text or text blocks; ``is_error`` when the tool failed."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    """An earlier assistant turn's thinking, given back (its ``signature`` is not checked: nothing is signed here)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    """Thinking another server redacted: there is nothing to show the model, so it is dropped."""

    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(_Wire):
    """One turn: ``user`` or ``assistant``, its content text or blocks."""

    role: Literal["user", "assistant"]
    content: str | list[Block]

    def has_images(self) -> bool:
        """Whether the turn has image blocks (reading them may fetch, so it runs off the event loop)."""
        return isinstance(self.content, list) and any(isinstance(b, ImageBlock) for b in self.content)


class ToolSpec(_Wire):
    """A client tool: ``name``, ``description`` and the JSON schema of its ``input``."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Wire):
    """``auto`` (the model decides), ``any`` (some call), ``tool`` (the named one), ``none`` (no call)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Wire):
    """``{"type": "enabled", "budget_tokens": N}`` (think at most N tokens), ``disabled``, or ``adaptive``."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Wire):
    """``{"type": "json_schema", "schema": {...}}``: the reply is JSON of that schema (held to it by a grammar)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Wire):
    """Structured output, and ``effort`` (accepted; the model's own length).

    ``format`` is what the anthropic SDK's ``messages.parse`` and LangChain's
    ``with_structured_output(method="json_schema")`` send.
    """

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(_Wire):
    """Anthropic's request metadata (accepted; nothing here uses it)."""

    user_id: str | None = None


class MessagesRequest(_Wire):
    """``POST /v1/messages``."""

    model: str
    """The served model (this server's name for it)."""
    max_tokens: int = Field(ge=1)
    """Most tokens to generate, thinking included (required, as in Anthropic's API)."""
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None
    """The structured-outputs beta's place for ``output_config.format``."""
    # Anthropic fields that change nothing here
    metadata: Metadata | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None

    def has_images(self) -> bool:
        """Whether any turn has image blocks."""
        return any(m.has_images() for m in self.messages)


class CountTokensRequest(_Wire):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


# --------------------------------------------------------------------------- responses


class UsageOut(BaseModel):
    """Token counts: ``input_tokens`` computed, ``cache_read_input_tokens`` reused from the prefix cache."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class TextOut(BaseModel):
    """A text block of the reply."""

    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    """The model's thinking (``signature`` empty: nothing is signed here)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(BaseModel):
    """A tool call the model made; its ``id`` comes back in the ``tool_result`` that answers it."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageOut(BaseModel):
    """``/v1/messages``, not streamed (and the ``message`` of a stream's ``message_start``)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: UsageOut


class CountTokensOut(BaseModel):
    """``/v1/messages/count_tokens``."""

    input_tokens: int


class ErrorDetail(BaseModel):
    """Anthropic's error: its ``type`` (``invalid_request_error``, ``authentication_error``, ...) and message."""

    type: str
    message: str


class ErrorOut(BaseModel):
    """Every error answer: ``{"type": "error", "error": {"type", "message"}}``."""

    type: Literal["error"] = "error"
    error: ErrorDetail


ALL_FIELDS = sorted(set(MessagesRequest.model_fields) | {"type", "text", "source", "tool_use_id", "input", "name"})
"""Field names for "did you mean" on a misspelt one."""
