"""The backend protocol: the only place that knows an inference library exists.

A backend turns (prompt ids, settings, constraint, cancel signal) into a stream of token ids.
Detokenizing, stop strings, usage and timing happen once, in the runtime.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ...errors import MissingDependencyError, UnsupportedModelError
from ..model_dir import ModelDirectory
from ..settings import GenerationSettings

if TYPE_CHECKING:
    from ..constraints import TokenConstraint
    from ..tokenizer import NativeTokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token, with the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class BackendRequest:
    """One generation as a backend sees it."""

    prompt_ids: list[int]
    settings: GenerationSettings
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    cancel: threading.Event = field(default_factory=threading.Event)
    constraint: TokenConstraint | None = None


@dataclass
class TokenStep:
    """Tokens produced by one decoding step (usually one)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class BackendOptions:
    """Load options shared by all backends; backend-specific ones travel in ``extra``."""

    max_seq_len: int | None = None
    dtype: str | None = None
    device: str | None = None
    extra: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        """A backend-specific option."""
        return dict(self.extra).get(key, default)


def require(module: str, extra: str, purpose: str) -> Any:
    """Import an optional module or raise MissingDependencyError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the library is there but one of *its* imports failed: show that
        raise MissingDependencyError(module, extra, purpose) from None


def cuda_available() -> bool:
    """Whether torch is installed and sees a CUDA device (imports torch only if it is installed)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


class Backend(ABC):
    """A loaded model on one inference library."""

    name: ClassVar[str]
    """Name used in ``backend=`` and logs."""
    extra: ClassVar[str]
    """The pip extra that installs it."""
    concurrent: ClassVar[bool] = False
    """Whether ``generate`` may run for several requests at once (dynamic batching)."""

    @classmethod
    @abstractmethod
    def check_available(cls) -> None:
        """Raise MissingDependencyError / BackendUnavailableError if it cannot run on this machine."""

    @classmethod
    @abstractmethod
    def check_model(cls, model: ModelDirectory) -> None:
        """Raise UnsupportedModelError (before anything is loaded) if it cannot run this model."""

    @abstractmethod
    def __init__(self, model: ModelDirectory, tokenizer: NativeTokenizer, options: BackendOptions) -> None:
        """Load the model. On failure, free whatever was allocated before raising."""

    @property
    @abstractmethod
    def context_length(self) -> int:
        """Longest prompt + completion this loaded model can hold."""

    @abstractmethod
    def generate(self, request: BackendRequest) -> Iterator[TokenStep]:
        """Yield generated tokens until ``max_new_tokens``, a stop token, or ``request.cancel``.

        Closing the iterator must free the request's resources within one decoding step.
        """

    @abstractmethod
    def close(self) -> None:
        """Free the model (and GPU memory). Idempotent."""

    def info(self) -> dict[str, Any]:
        """Facts about the loaded model for metadata and logs."""
        return {"backend": self.name}


def unsupported(backend: str, model: ModelDirectory, why: str) -> UnsupportedModelError:
    """A consistent UnsupportedModelError."""
    return UnsupportedModelError(f"backend {backend!r} cannot run {model.name!r}: {why}")
