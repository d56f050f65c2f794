"""The wire form of the contract: JSON of every contract value, to and from, and of typed errors.

One form for every boundary that is not a function call: the native HTTP endpoint (``/v1/exllama/...``),
the engine process and Ray deployment handles. Reading is forward-compatible (a field this side does not
know is ignored, so an older client reads a newer server) and strict about what it knows (a bad value is a
typed error: :class:`~exllama_integrations.errors.InvalidSettingsError` for what a client sent,
:class:`~exllama_integrations.errors.ProtocolError` for what a server sent). Generation settings are the
exception to "ignored": an unknown setting is refused, never dropped.

Example:
    >>> from exllama_integrations.contract.api import GenerationRequest
    >>> data = dumps(GenerationRequest("The sky is"))
    >>> loads_request(data).prompt
    'The sky is'
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError
from pydantic_core import SchemaValidator

from ..errors import (
    ExLlamaIntegrationsError,
    InvalidSettingsError,
    ProtocolError,
    error_from_wire,
    error_to_wire,
)
from .api import GenerationRequest, GenerationResult, ModelInfo, StreamChunk
from .retrieval import EmbeddingInfo, EmbeddingRequest, EmbeddingResult, RerankRequest, RerankResult
from .validation import first_error_reader

T = TypeVar("T")

MAX_EVENT_BYTES = 64 * 2**20
"""Largest single wire value read (a request with images, a chunk, model info)."""

_REQUEST = TypeAdapter(GenerationRequest)
_CHUNK = TypeAdapter(StreamChunk)
_RESULT = TypeAdapter(GenerationResult)
_INFO = TypeAdapter(ModelInfo)
_EMBED_REQUEST = TypeAdapter(EmbeddingRequest)
_EMBED_RESULT = TypeAdapter(EmbeddingResult)
_RERANK_REQUEST = TypeAdapter(RerankRequest)
_RERANK_RESULT = TypeAdapter(RerankResult)
_EMBED_INFO = TypeAdapter(EmbeddingInfo)
# what a client sends is read stopping at a container's first bad item (a million wrong ids cost one error)
_REQUEST_READER = first_error_reader(GenerationRequest)
_EMBED_REQUEST_READER = first_error_reader(EmbeddingRequest)
_RERANK_REQUEST_READER = first_error_reader(RerankRequest)
_ADAPTERS: dict[type, TypeAdapter[Any]] = {
    GenerationRequest: _REQUEST,
    StreamChunk: _CHUNK,
    GenerationResult: _RESULT,
    ModelInfo: _INFO,
    EmbeddingRequest: _EMBED_REQUEST,
    EmbeddingResult: _EMBED_RESULT,
    RerankRequest: _RERANK_REQUEST,
    RerankResult: _RERANK_RESULT,
    EmbeddingInfo: _EMBED_INFO,
}
Value = (
    GenerationRequest
    | StreamChunk
    | GenerationResult
    | ModelInfo
    | EmbeddingRequest
    | EmbeddingResult
    | RerankRequest
    | RerankResult
    | EmbeddingInfo
)
"""Every contract value that has a wire form."""


def dumps(value: Value) -> bytes:
    """A contract value as JSON bytes."""
    return _ADAPTERS[type(value)].dump_json(value)


def to_data(value: Value) -> Any:
    """A contract value as JSON-ready Python data (dicts, lists, strings, numbers)."""
    return json.loads(dumps(value))


def _read(
    adapter: TypeAdapter[Any] | SchemaValidator, data: str | bytes | dict[str, Any], what: str, server: bool
) -> Any:
    try:
        if isinstance(data, (str, bytes)):
            if len(data) > MAX_EVENT_BYTES:
                raise ValueError(f"{len(data)} bytes, more than the {MAX_EVENT_BYTES} a {what} may be")
            return adapter.validate_json(data)
        return adapter.validate_python(data)
    except ExLlamaIntegrationsError:
        raise
    except (ValidationError, ValueError, TypeError, RecursionError) as e:
        message = _describe(e)
        if server:
            raise ProtocolError(f"the server sent a {what} this client cannot read: {message}") from None
        raise InvalidSettingsError(f"invalid {what}: {message}") from None


def _describe(e: Exception) -> str:
    if isinstance(e, ValidationError):
        lines = []
        for err in e.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(lines)
    return f"{type(e).__name__}: {e}"


def loads_request(data: str | bytes | dict[str, Any]) -> GenerationRequest:
    """A request a client sent. Raises InvalidSettingsError (naming the field) when it is not one."""
    return _read(_REQUEST_READER, data, "request", server=False)


def loads_chunk(data: str | bytes | dict[str, Any]) -> StreamChunk:
    """A stream chunk a server sent. Raises ProtocolError when it is not one."""
    return _read(_CHUNK, data, "stream chunk", server=True)


def loads_result(data: str | bytes | dict[str, Any]) -> GenerationResult:
    """A result a server sent. Raises ProtocolError when it is not one."""
    return _read(_RESULT, data, "result", server=True)


def loads_info(data: str | bytes | dict[str, Any]) -> ModelInfo:
    """Model info a server sent. Raises ProtocolError when it is not one."""
    return _read(_INFO, data, "model info", server=True)


def loads_embedding_request(data: str | bytes | dict[str, Any]) -> EmbeddingRequest:
    """An embedding request a client sent. Raises InvalidSettingsError (naming the field) when it is not one."""
    return _read(_EMBED_REQUEST_READER, data, "embedding request", server=False)


def loads_rerank_request(data: str | bytes | dict[str, Any]) -> RerankRequest:
    """A rerank request a client sent. Raises InvalidSettingsError (naming the field) when it is not one."""
    return _read(_RERANK_REQUEST_READER, data, "rerank request", server=False)


def loads_embedding_result(data: str | bytes | dict[str, Any]) -> EmbeddingResult:
    """Embeddings a server sent. Raises ProtocolError when they are not."""
    return _read(_EMBED_RESULT, data, "embedding result", server=True)


def loads_rerank_result(data: str | bytes | dict[str, Any]) -> RerankResult:
    """A rerank result a server sent. Raises ProtocolError when it is not one."""
    return _read(_RERANK_RESULT, data, "rerank result", server=True)


def loads_embedding_info(data: str | bytes | dict[str, Any]) -> EmbeddingInfo:
    """An embedding model's facts a server sent. Raises ProtocolError when they are not."""
    return _read(_EMBED_INFO, data, "embedding info", server=True)


def dumps_error(e: ExLlamaIntegrationsError) -> bytes:
    """A typed error as JSON bytes: ``{"error": {"code", "message", "fields"}}``."""
    return json.dumps({"error": error_to_wire(e)}, ensure_ascii=False).encode()


def loads_error(data: Any, status: int | None = None) -> ExLlamaIntegrationsError:
    """The typed error a wire form (``{"error": {...}}``) stands for, as its own class."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except (ValueError, RecursionError):
            return ProtocolError(f"the server answered {status}: {str(data)[:300]!r}", status)
    err = data.get("error") if isinstance(data, dict) else None
    return error_from_wire(err, status)


__all__ = [
    "MAX_EVENT_BYTES",
    "dumps",
    "dumps_error",
    "loads_chunk",
    "loads_embedding_info",
    "loads_embedding_request",
    "loads_embedding_result",
    "loads_error",
    "loads_info",
    "loads_request",
    "loads_rerank_request",
    "loads_rerank_result",
    "loads_result",
    "to_data",
]
