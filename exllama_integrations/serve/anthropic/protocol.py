"""Anthropic's Messages API wire schema, requests AND responses, as pydantic models (so the OpenAPI schema is true).

A request turns into the one chat request every front door uses on the model itself
(:meth:`MessagesRequest.to_chat`): ``system`` becomes the system turn; text and image blocks (base64 or url
sources, read by :mod:`~exllama_integrations.model.media`) a user turn's content; ``tool_use`` blocks the
assistant's tool calls and ``tool_result`` blocks tool turns answering them by id; ``thinking`` blocks the earlier
turn's reasoning; ``tools`` / ``tool_choice`` OpenAI's specs; ``thinking`` the reasoning budget
(``max_reasoning_tokens``) or ``enable_thinking=False`` for the template; ``output_config.format`` (structured output)
a JSON-schema reply held to it by a grammar. Fields Anthropic documents that change
nothing here (``metadata``, ``service_tier``, ``cache_control``) are accepted; any other is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...chat.content import content_of
from ...chat.prepare import ChatRequest
from ...contract.api import Media
from ...contract.settings import GenerationSettings, resolve_settings
from ...errors import InvalidSettingsError, MediaError
from ...model.media import MediaLimits, media_from_base64, media_from_url


class _Wire(BaseModel):
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

    def to_media(self, limits: MediaLimits) -> Media:
        """The image as the contract's value, read within ``limits``."""
        if self.type == "base64":
            if not self.data:
                raise MediaError("an image source of type base64 needs its data.", param="messages")
            return media_from_base64(self.data, self.media_type, limits)
        if not self.url:
            raise MediaError("an image source of type url needs its url.", param="messages")
        return media_from_url(self.url, limits)


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

    def text(self) -> str:
        """The result as the text a tool turn carries (a failed tool's result says so)."""
        if self.content is None or isinstance(self.content, str):
            body = self.content or ""
        else:
            if any(isinstance(b, ImageBlock) for b in self.content):
                raise MediaError(
                    "images in a tool_result are not taken here; send the image in a user turn's image block.",
                    param="messages",
                )
            body = "\n".join(b.text for b in self.content if isinstance(b, TextBlock))
        return f"Error: {body}" if self.is_error else body


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

    def to_openai(self) -> dict[str, Any]:
        """The tool as the OpenAI-style spec the chat layer takes."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Wire):
    """``auto`` (the model decides), ``any`` (some call), ``tool`` (the named one), ``none`` (no call)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def to_openai(self) -> Any:
        """OpenAI's tool_choice for the chat layer."""
        if self.type == "tool":
            if not self.name:
                raise InvalidSettingsError("tool_choice of type tool needs the tool's name.", param="tool_choice")
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


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

    def to_settings(
        self, defaults: GenerationSettings, refused: Mapping[str, str], max_tokens_cap: int | None
    ) -> GenerationSettings:
        """The request's settings over the server's defaults, resolved once.

        Raises:
            InvalidSettingsError: ``max_tokens`` over the server's cap (``serve --max-tokens``), or a setting
                the backend cannot honour.
        """
        if max_tokens_cap is not None and self.max_tokens > max_tokens_cap:
            raise InvalidSettingsError(
                f"max_tokens is {self.max_tokens}; this server allows at most {max_tokens_cap}.",
                param="max_tokens",
                reason="max_tokens_too_large",
            )
        budget = self.thinking.budget_tokens if self.thinking and self.thinking.type == "enabled" else None
        if self.thinking and self.thinking.type == "enabled" and budget is None:
            raise InvalidSettingsError("thinking of type enabled needs budget_tokens.", param="thinking.budget_tokens")
        values: dict[str, Any] = {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "max_reasoning_tokens": budget,
        }
        return resolve_settings(defaults, refused, **{k: v for k, v in values.items() if v is not None})

    def to_chat(
        self,
        defaults: GenerationSettings,
        refused: Mapping[str, str],
        max_tokens_cap: int | None = None,
        chat_template: str | None = None,
        media_limits: MediaLimits | None = None,
    ) -> ChatRequest:
        """The call as the plain-data chat request every front door uses (images read within ``media_limits``).

        Raises:
            InvalidSettingsError: a tool_result that answers no call of the turn before it, or bad settings.
            MediaError: an image refused (or an image outside a user turn).
        """
        media: list[Media] = []
        limits = media_limits or MediaLimits()
        messages: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) or self.system is None else _joined(self.system)
        if system:
            messages.append({"role": "system", "content": system})
        calls: dict[str, str] = {}  # the previous assistant turn's tool_use ids -> their tools' names
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                messages.append(_assistant_turn(m))
                calls = {c["id"]: c["function"]["name"] for c in messages[-1].get("tool_calls", ())}
            else:
                messages.extend(_user_turns(m, i, calls, media, limits))
                calls = {}
        kwargs: dict[str, Any] = {}
        if self.thinking is not None and self.thinking.type != "adaptive":
            kwargs["enable_thinking"] = self.thinking.type == "enabled"
        tools = [t.to_openai() for t in self.tools or ()]
        choice = self.tool_choice.to_openai() if self.tool_choice is not None and tools else None
        single = self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use
        form = self.output_config.format if self.output_config is not None else None
        form = form or self.output_format
        return ChatRequest(
            messages=messages,
            settings=self.to_settings(defaults, refused, max_tokens_cap),
            tools=tools,
            tool_choice=choice,
            response_format={"type": "json_schema", "json_schema": {"schema": form.schema_}} if form else None,
            parallel_tool_calls=False if single else None,
            template_kwargs=kwargs,
            chat_template=chat_template,
            media=media,
        )


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _assistant_turn(m: MessageParam) -> dict[str, Any]:
    """An assistant turn in Hugging Face conventions: text, tool calls, earlier thinking."""
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    text, thought, calls = [], [], []
    for b in m.content:
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thought.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif not isinstance(b, RedactedThinkingBlock):
            raise InvalidSettingsError(
                f"an assistant turn takes text, thinking and tool_use blocks, not {b.type}.", param="messages"
            )
    d: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        d["tool_calls"] = calls
    if thought:
        d["reasoning_content"] = "\n".join(thought)
    return d


def _user_turns(
    m: MessageParam, i: int, calls: Mapping[str, str], media: list[Media], limits: MediaLimits
) -> list[dict[str, Any]]:
    """A user turn: its tool results first (one tool turn each, by the call they answer), then its text and images."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict[str, Any]] = []
    pieces: list[str | Media] = []
    for b in m.content:
        if isinstance(b, ToolResultBlock):
            if b.tool_use_id not in calls:
                raise InvalidSettingsError(
                    f"messages.{i}: tool_result answers tool_use_id {b.tool_use_id!r}, which is no tool_use block "
                    f"of the assistant turn before it (its calls: {sorted(calls)}).",
                    param=f"messages.{i}.content",
                )
            out.append(
                {"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id, "name": calls[b.tool_use_id]}
            )
        elif isinstance(b, TextBlock):
            pieces.append(b.text)
        elif isinstance(b, ImageBlock):
            pieces.append(b.source.to_media(limits))
        else:
            raise InvalidSettingsError(
                f"messages.{i}: a user turn takes text, image and tool_result blocks, not {b.type}.",
                param=f"messages.{i}.content",
            )
    if pieces:
        out.append({"role": "user", "content": content_of(pieces, media)})
    return out


class CountTokensRequest(_Wire):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    def to_messages_request(self) -> MessagesRequest:
        """The same prompt as a Messages request (``max_tokens`` 1: nothing is generated)."""
        return MessagesRequest(max_tokens=1, **self.model_dump(exclude_none=True, by_alias=True))


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
