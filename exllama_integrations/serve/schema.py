"""The OpenAI wire schema of requests, as pydantic models (responses are built as plain dicts in app.py).

OpenAI's own fields are accepted as its clients send them; those we cannot honour (``n`` > 1,
penalties other than 0, ``logit_bias``) are refused with a 400 naming the field, never ignored.
Extensions use vLLM's names where it has one (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``add_special_tokens``; ours include ``return_details`` and
``incremental``) and are listed in the README. A field that is neither is refused (a typo must not be
silently dropped).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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


class _Common(_Wire):
    model: str
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
    return_details: bool = False
    """Add ``exllama`` to each choice: token ids, logprobs with ids, native finish, timings (RemoteRuntime uses it)."""
    incremental: bool = True
    """With ``stream``: False when the client wants the whole completion (RemoteRuntime's ``generate``): the
    events come when it ends (every few steps while stop strings are watched), sparing the server a wake-up
    per token."""


class FunctionCall(_Wire):
    """A tool call's function: its name and arguments (JSON text, or an object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallWire(_Wire):
    """An assistant message's tool call."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    """A message content part; only ``text`` parts are accepted (others are refused when read)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class MessageWire(_Wire):
    """A chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


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
    # extensions
    chat_template_kwargs: dict[str, Any] | None = None
    split_special_tokens: bool = False
