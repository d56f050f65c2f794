"""The OpenAI endpoints' wire schema, requests AND responses, one module per API (so the OpenAPI schema is true).

:mod:`.common` holds what every endpoint shares (the strict base, the sampling fields, usage, errors),
:mod:`.completions`, :mod:`.chat` and :mod:`.models` each one API's models. The names are re-exported here,
as they were importable before the split.
"""

from __future__ import annotations

from .chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDeltaWire,
    ContentPart,
    FunctionCall,
    FunctionDelta,
    FunctionSpec,
    ImageURL,
    MessageWire,
    ToolCallDelta,
    ToolCallOut,
    ToolCallWire,
    ToolWire,
)
from .common import (
    SETTING_FIELDS,
    CommonRequest,
    ErrorBody,
    ErrorResponse,
    GrammarWire,
    StreamOptions,
    UsageWire,
    Wire,
    _Wire,
    refuse,
)
from .completions import CompletionChoice, CompletionRequest, CompletionResponse
from .models import ModelCard, ModelList

ALL_FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))
"""Every request field name (for "did you mean" on a misspelt one)."""

__all__ = [
    "ALL_FIELDS",
    "SETTING_FIELDS",
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDeltaWire",
    "CommonRequest",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "ContentPart",
    "ErrorBody",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDelta",
    "FunctionSpec",
    "GrammarWire",
    "ImageURL",
    "MessageWire",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "ToolCallDelta",
    "ToolCallOut",
    "ToolCallWire",
    "ToolWire",
    "UsageWire",
    "Wire",
    "_Wire",
    "refuse",
]
