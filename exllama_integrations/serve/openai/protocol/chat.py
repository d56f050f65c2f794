"""``/v1/chat/completions``' wire models: messages, tools, the request, the reply and its stream chunks.

What each field means for the chat is :mod:`..convert`'s.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from ....contract.validation import FirstErrorModel
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


class ImageURL(FirstErrorModel):
    """An ``image_url`` part's reference: a ``data:image/...;base64,`` URL (http(s) only where the server allows)."""

    model_config = ConfigDict(extra="allow")

    url: str
    detail: str | None = None


class ContentPart(FirstErrorModel):
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


class _Unsent(BaseModel):
    """A stream delta whose fields not sent in this event are left out, not written as null, as OpenAI streams them.

    The openai SDK's ``chat.completions.stream()`` overwrites a call's ``type`` with each delta's value.
    """

    @model_serializer(mode="wrap")
    def _leave_out_unsent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionDelta(_Unsent):
    """More of a streamed call: its name with its first delta, then its arguments' text as they are written."""

    name: str | None = None
    arguments: str = ""


class ToolCallDelta(_Unsent):
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
