"""The pooling backend contract on one page, and the pooling arithmetic every pooling backend shares.

A pooling backend holds an embedding or rerank model on one inference library and turns a batch of token-id
sequences into vectors (:meth:`PoolingBackend.embed`: pooled as the model's sentence-transformers config says,
normalised where it has a Normalize module) or relevance scores (:meth:`PoolingBackend.score`). It pads a batch
itself (on the right, with an attention mask where the library takes one; a causal model's real tokens never see
the padding after them). Tokenizing, prompts, limits, batching and Matryoshka truncation happen once, above it,
in :class:`~exllama_integrations.runtime.local.embedding.EmbeddingRuntime`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from ..base import BackendOptions

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ...model.directory import ModelDirectory
    from ...model.pooling import PoolingConfig


@dataclass(frozen=True)
class Encoded:
    """One input as the model reads it: token ids, and segment ids where the model takes them (BERT pairs)."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ScoringTokens:
    """What a yes/no reranker reads its answer from: the ids of "yes" and "no"."""

    yes: int
    no: int


class PoolingOptions(BackendOptions):
    """Load options of every pooling backend (each may add its own)."""

    max_batch_size: int = Field(default=32, ge=1, le=4096)
    """Inputs computed together in one forward pass."""
    max_batch_tokens: int = Field(default=16384, ge=16)
    """Most padded tokens in one forward pass (batch size x its longest input): bounds the memory a batch takes."""
    num_threads: int | None = Field(default=None, ge=1, le=256)
    """CPU threads (transformers on the CPU; process-wide, as torch's setting is). None: cores - 1, at most 8."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Shorter vector lengths the model was trained for, where its config.json does not say (``()``: any)."""
    progressbar: bool | None = None
    """The library's load bar; None: when stderr is a terminal or in a notebook."""


class PoolingBackend(ABC):
    """An embedding or rerank model loaded on one inference library."""

    name: ClassVar[str]
    Options: ClassVar[type[PoolingOptions]] = PoolingOptions

    @classmethod
    @abstractmethod
    def check_available(cls) -> None:
        """Raise MissingDependencyError / BackendUnavailableError if it cannot run here."""

    @classmethod
    @abstractmethod
    def check_model(cls, model: ModelDirectory, pooling: PoolingConfig) -> None:
        """Raise UnsupportedModelError (before loading) if it cannot run this model for this task."""

    @classmethod
    def resolve_options(cls, options: PoolingOptions) -> PoolingOptions:
        """Options with the backend's defaults filled in (so equal loads share one registry entry)."""
        return options

    @abstractmethod
    def __init__(
        self, model: ModelDirectory, pooling: PoolingConfig, options: PoolingOptions, tokens: ScoringTokens | None
    ) -> None:
        """Load the model; on failure free what was allocated before raising."""

    dimensions: int = 0
    """Length of the vectors :meth:`embed` returns (0 for a reranker)."""

    @abstractmethod
    def embed(self, batch: Sequence[Encoded]) -> np.ndarray:
        """Pooled (and, per the config, normalised) vectors of a batch: float32, one row per input."""

    @abstractmethod
    def score(self, batch: Sequence[Encoded]) -> np.ndarray:
        """Relevance of each (query, document) input: float32, one per input."""

    @abstractmethod
    def close(self) -> None:
        """Free the model. Idempotent; always returns."""

    def info(self) -> dict[str, Any]:
        """Facts for metadata and logs (device, dtype ...)."""
        return {}


def padded(batch: Sequence[Encoded], pad_id: int) -> tuple[list[list[int]], list[list[int]], list[list[int]] | None]:
    """Ids right-padded to the longest, the attention mask, and segment ids where the inputs have them."""
    width = max(len(e.ids) for e in batch)
    ids = [list(e.ids) + [pad_id] * (width - len(e.ids)) for e in batch]
    mask = [[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in batch]
    types = None
    if all(e.type_ids is not None for e in batch):
        types = [list(e.type_ids or ()) + [0] * (width - len(e.ids)) for e in batch]
    return ids, mask, types


def pool(states: torch.Tensor, mask: torch.Tensor, modes: Sequence[str], normalize: bool) -> torch.Tensor:
    """sentence-transformers' Pooling (then Normalize) over right-padded token states, in float32.

    ``states``: (batch, tokens, hidden); ``mask``: (batch, tokens), 1 for a real token. Several modes are
    concatenated in the order given (sentence-transformers' own order).
    """
    import torch

    x = states.float()
    m = mask.to(x.device).unsqueeze(-1).float()
    counts = m.sum(1).clamp(min=1e-9)
    last = mask.to(x.device).long().sum(1) - 1
    outs = []
    for mode in modes:
        if mode == "cls":
            outs.append(x[:, 0])
        elif mode == "max":
            outs.append(x.masked_fill(m == 0, -1e9).max(1).values)
        elif mode == "mean":
            outs.append((x * m).sum(1) / counts)
        elif mode == "mean_sqrt_len":
            outs.append((x * m).sum(1) / counts.sqrt())
        elif mode == "weightedmean":
            w = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1) * m
            outs.append((x * w).sum(1) / w.sum(1).clamp(min=1e-9))
        elif mode == "lasttoken":
            outs.append(x[torch.arange(x.shape[0], device=x.device), last])
        else:  # read_pooling names only the modes above
            raise AssertionError(mode)
    out = torch.cat(outs, dim=-1)
    return torch.nn.functional.normalize(out, p=2, dim=-1) if normalize else out


__all__ = ["Encoded", "PoolingBackend", "PoolingOptions", "ScoringTokens", "padded", "pool"]
