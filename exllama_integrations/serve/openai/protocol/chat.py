"""``/v1/chat/completions``' wire models: messages, tools, the request, the reply and its stream chunks.

A request turns into the plain-data chat request every front door uses on the model itself
(:meth:`ChatCompletionRequest.to_chat`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ....chat.content import content_of
from ....chat.prepare import ChatRequest
from ....contract.api import Media
from ....contract.settings import GenerationSettings
from ....errors import MediaError
from ....model.media import MediaLimits, media_from_url
from .common import CommonRequest, UsageWire, Wire


class FunctionCall(Wire):
    """A tool call's function: its name and arguments (JSON text, or an object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallWire(Wire):
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


class MessageWire(Wire):
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


class FunctionSpec(Wire):
    """A tool's function: name, description and JSON-schema parameters."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolWire(Wire):
    """A tool offered to the model."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatCompletionRequest(CommonRequest):
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
