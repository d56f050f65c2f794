"""``POST /v1/embeddings``'s wire models: OpenAI's request and response, and their conversion to the contract.

``input`` is a text, a list of texts, a list of token ids or a list of such lists; ``encoding_format`` ``float`` or
``base64`` (float32 little-endian, what the openai client asks for by default); ``dimensions`` only where the model
declares Matryoshka training. Extensions: ``input_type`` (``query``/``document``: the model's prompt for that role)
and ``truncate`` (keep an over-long input's first tokens instead of a 400), as TEI names it.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from ....contract.retrieval import MAX_INPUTS, EmbeddingRequest, EmbeddingResult
from .common import Wire, texts_or_ids


class EmbeddingBody(Wire):
    """OpenAI's embeddings request (and two extensions, see the module docstring)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    input_type: Literal["query", "document"] | None = None
    truncate: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, value: Any) -> Any:
        return texts_or_ids(value, "input", MAX_INPUTS)

    def to_request(self) -> EmbeddingRequest:
        """The contract's request (a bad input is an InvalidSettingsError, 400)."""
        items = self.input
        inputs: list[str | list[int]]
        if isinstance(items, str):
            inputs = [items]
        elif items and all(isinstance(i, int) for i in items):
            inputs = [items]  # type: ignore[list-item]  # one list of token ids
        else:
            inputs = list(items)  # type: ignore[arg-type]
        return EmbeddingRequest(
            tuple(inputs),  # type: ignore[arg-type]  # checked and made tuples there
            input_type=self.input_type,
            truncate=self.truncate,
            dimensions=self.dimensions,
        )


class EmbeddingData(BaseModel):
    """One vector, in the input's place."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Tokens read (prompts included)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """OpenAI's embeddings response."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage

    @classmethod
    def of(cls, result: EmbeddingResult, model: str, encoding: str) -> EmbeddingResponse:
        """The response for a result, its vectors as floats or base64."""
        d = result.dimensions
        rows: list[list[float] | str]
        if encoding == "base64":
            rows = [base64.b64encode(result.row(i)).decode() for i in range(result.count)]
        else:
            rows = [list(struct.unpack(f"<{d}f", result.row(i))) for i in range(result.count)]
        data = [EmbeddingData(index=i, embedding=row) for i, row in enumerate(rows)]
        usage = EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
        return cls(data=data, model=model, usage=usage)


__all__ = ["EmbeddingBody", "EmbeddingData", "EmbeddingResponse", "EmbeddingUsage"]
