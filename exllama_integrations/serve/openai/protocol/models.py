"""``/v1/models``' wire models: the served model's card and the list."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ModelCard(BaseModel):
    """A model this server serves."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "exllama-integrations"
    context_length: int
    max_model_len: int
    backend: str
    tool_format: str | None = None
    """The tool-call format the server reads and writes calls in (a name of ``chat.formats.FORMATS``: the one
    found in the model, or ``serve --tool-format``)."""


class ModelList(BaseModel):
    """``/v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
