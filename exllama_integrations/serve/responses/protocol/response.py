"""The Responses API's response object and its output items, as wire models (so the OpenAPI schema is true).

A reply is output items in the order the model wrote them: a ``reasoning`` item (its thinking, as
``reasoning_text``), a ``message`` item (its answer, as ``output_text``) and a ``function_call`` item per call
(``call_id`` is the call's id). ``status`` is ``"incomplete"`` with ``incomplete_details.reason:
"max_output_tokens"`` when the reply was cut there. Usage is in the Responses shape: ``input_tokens`` (its
``cached_tokens``: prompt tokens reused from the prefix cache), ``output_tokens`` (its ``reasoning_tokens``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from ....contract.api import Usage
from .options import FormatText, FunctionChoice, FunctionTool, ReasoningConfig, TextConfig
from .request import ResponsesRequest


def _plain_text(body: ResponsesRequest) -> TextConfig:
    """The ``text`` a request without a format is answered in (OpenAI echoes ``{"format": {"type": "text"}}``)."""
    verbosity = body.text.verbosity if body.text is not None else None
    return TextConfig(format=FormatText(type="text"), verbosity=verbosity)


def new_id(prefix: str) -> str:
    """An id in OpenAI's form for its objects (``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputTextPart(BaseModel):
    """A message's text."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningTextPart(BaseModel):
    """A reasoning item's text."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    """The assistant's answer."""

    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextPart]


class OutputReasoning(BaseModel):
    """The model's thinking before its answer (``summary`` stays empty: the text itself is in ``content``)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    status: ItemStatus
    summary: list[Any] = []
    content: list[ReasoningTextPart]


class OutputFunctionCall(BaseModel):
    """A call the model made; run it and send its result back as a ``function_call_output`` with this ``call_id``."""

    type: Literal["function_call"] = "function_call"
    id: str
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


OutputItem = Annotated[OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    """What the input tokens were."""

    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """What the output tokens were."""

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts in the Responses shape."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        """The contract's usage in this shape."""
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
            total_tokens=usage.total_tokens,
        )


class IncompleteDetails(BaseModel):
    """Why a response is incomplete."""

    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    """What made a response fail (in a ``response.failed`` event)."""

    code: str
    message: str


class ResponseObject(BaseModel):
    """``POST /v1/responses``' answer (and the ``response`` of its stream's lifecycle events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    # the request's options, as OpenAI echoes them
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    store: bool = False
    """Always false: this server keeps no responses."""
    temperature: float | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    tools: list[FunctionTool] = []
    top_p: float | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    truncated_input_items: int | None = None
    """(An extension.) With ``truncation: "auto"``: how many of the oldest input items were dropped to fit the
    context (None: none were)."""
    metadata: dict[str, str] = {}
    user: str | None = None
    background: bool = False
    service_tier: str = "default"

    @classmethod
    def draft(cls, body: ResponsesRequest, model: str, dropped: int = 0) -> ResponseObject:
        """The response to ``body`` before any output: in progress, with the request's options echoed.

        ``dropped``: how many input items ``truncation: "auto"`` dropped.
        """
        return cls(
            truncation=body.truncation or "disabled",
            truncated_input_items=dropped or None,
            id=new_id("resp"),
            model=model,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            max_tool_calls=body.max_tool_calls,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            reasoning=body.reasoning or ReasoningConfig(),
            temperature=body.temperature,
            text=body.text if body.text is not None and body.text.format is not None else _plain_text(body),
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            top_p=body.top_p,
            metadata=body.metadata or {},
            user=body.user,
        )

    def wire(self) -> dict[str, Any]:
        """As JSON data (field aliases, such as a format's ``schema``, by their wire names)."""
        return self.model_dump(mode="json", by_alias=True)
