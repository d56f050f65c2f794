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
from .common import CommonRequest, UsageWire, Wire, refuse


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
    refusal: str | None = None
    """An assistant turn's ``refusal`` part: its text is the turn's text."""


class MessageWire(Wire):
    """A chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None
    """The legacy form of one tool call (an assistant turn)."""
    refusal: str | None = None
    reasoning_content: str | None = None
    """An earlier assistant turn's thinking (the template keeps or strips it)."""
    reasoning: str | None = None
    """vLLM's newer name for ``reasoning_content``."""

    def has_images(self) -> bool:
        """Whether the message has image parts (reading them may fetch, so it runs off the event loop)."""
        return isinstance(self.content, list) and any(p.type not in ("text", "refusal") for p in self.content)

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
            elif part.type == "refusal" and self.role == "assistant":
                pieces.append(part.refusal or "")
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
        elif self.function_call is not None:  # the legacy form of one tool call
            d["tool_calls"] = [ToolCallWire(function=self.function_call).model_dump()]
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


class FunctionName(Wire):
    """A legacy ``function_call`` that names the function to call."""

    name: str


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
    """False: at most one call in a reply."""
    functions: list[FunctionSpec] | None = None
    """OpenAI's legacy form of ``tools`` (read as function tools)."""
    function_call: Literal["none", "auto"] | FunctionName | None = None
    """OpenAI's legacy form of ``tool_choice``."""
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """``none`` turns thinking off where the template has a switch (``enable_thinking``); any other effort turns
    it on; the template sees the value itself too (gpt-oss's templates read it)."""
    modalities: list[Literal["text", "audio"]] | None = None
    """Only ``["text"]`` is served."""
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted, ignored (the model's own length)."""
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
        thinking_switch: bool = False,
    ) -> ChatRequest:
        """The chat call as the plain-data chat request every front door uses (images read within ``media_limits``).

        ``thinking_switch``: the template reads ``enable_thinking`` (``reasoning_effort`` sets it).

        Raises:
            InvalidSettingsError: audio asked for, or ``tools`` and the legacy ``functions`` both sent.
        """
        if self.modalities is not None and "audio" in self.modalities:
            raise refuse("modalities", 'only text is served; send modalities ["text"] or leave it out.')
        if self.functions is not None and self.tools is not None:
            raise refuse("functions", "send tools or the legacy functions, not both.")
        if self.function_call is not None and self.tool_choice is not None:
            raise refuse("function_call", "send tool_choice or the legacy function_call, not both.")
        if self.tools is not None:
            tools = [t.model_dump(exclude_none=True) for t in self.tools]
        else:
            tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions or []]
        choice: Any = self.tool_choice
        if isinstance(self.function_call, FunctionName):
            choice = {"type": "function", "function": {"name": self.function_call.name}}
        elif self.function_call is not None:
            choice = self.function_call
        media: list[Media] = []
        messages = [m.to_template(media, media_limits) for m in self.messages]
        template_kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            template_kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            if thinking_switch:
                template_kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return ChatRequest(
            messages=messages,
            settings=self.to_settings(defaults, refused, max_tokens_cap),
            tools=tools,
            tool_choice=choice if tools else None,
            response_format=self.response_format,
            template_kwargs=template_kwargs,
            chat_template=chat_template,
            split_special_tokens=self.split_special_tokens,
            media=media,
            parallel_tool_calls=self.parallel_tool_calls,
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


class FunctionDelta(BaseModel):
    """More of a streamed call: its name with its first delta, then its arguments' text as they are written."""

    name: str | None = None
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """A stream's tool-call delta, as OpenAI streams them.

    The first of a call carries its ``id``, ``type`` and name, the rest only ``index`` and more ``function.arguments``.
    """

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


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
    tool_calls: list[ToolCallOut | ToolCallDelta] | None = None


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
