"""The runtime: the contract (``api``), its in-process implementation, and what both share.

Adapters import :mod:`.api` and build a runtime; nothing here imports torch or a backend until a
model is loaded.
"""

from .api import (
    GenerationResult,
    Grammar,
    ModelInfo,
    Runtime,
    StreamChunk,
    TextStream,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .local import ExLlamaRuntime
from .local.run import LocalStream
from .model_dir import ModelDirectory
from .settings import GenerationSettings
from .streaming import IncrementalDetokenizer, StopStringMatcher
from .tokenizer import NativeTokenizer

GenerationStream = LocalStream
"""The in-process stream type (the name of earlier releases)."""


def __getattr__(name: str) -> object:
    if name == "GenerationChunk":
        import warnings

        warnings.warn(
            "GenerationChunk was renamed StreamChunk (it clashed with LangChain's GenerationChunk).",
            DeprecationWarning,
            stacklevel=2,
        )
        return StreamChunk
    raise AttributeError(name)


__all__ = [
    "ExLlamaRuntime",
    "GenerationResult",
    "GenerationSettings",
    "GenerationStream",
    "Grammar",
    "IncrementalDetokenizer",
    "LocalStream",
    "ModelDirectory",
    "ModelInfo",
    "NativeTokenizer",
    "Runtime",
    "StopStringMatcher",
    "StreamChunk",
    "TextStream",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]
