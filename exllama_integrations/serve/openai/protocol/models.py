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


class ModelMemory(BaseModel):
    """A served model's memory in bytes: estimated from its files, measured once loaded, and what is counted."""

    estimate: dict[str, int]
    counted: dict[str, int]
    measured: dict[str, int] | None = None


class ServedModelCard(ModelCard):
    """A model of a server of several models, with its state (``exllama-integrations serve DIR DIR ...``)."""

    state: Literal["unloaded", "loading", "loaded", "unloading"]
    """Whether it is loaded now (a request for an unloaded model loads it, and waits)."""
    pinned: bool
    """Loaded when the server starts and never unloaded."""
    kind: str
    """What it serves: ``chat``, ``embedding`` or ``rerank``."""
    keep_alive: float
    """Seconds it stays loaded after its last request (-1: for ever)."""
    expires_in: float | None = None
    """Seconds until it is unloaded for idleness, if no request comes first."""
    in_flight: int
    """Requests holding it (waiting for its load, or being answered)."""
    memory: ModelMemory
    error: str | None = None
    """Why its last load failed (until one succeeds)."""


class ModelList(BaseModel):
    """``/v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServedModelList(BaseModel):
    """``/v1/models`` of a server of several models."""

    object: Literal["list"] = "list"
    data: list[ServedModelCard]
