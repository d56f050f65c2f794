"""The in-process runtimes: a model loaded in this process (registry, run, runtime; embedding and rerank models)."""

from .embedding import EmbeddingRuntime
from .runtime import ExLlamaRuntime

__all__ = ["EmbeddingRuntime", "ExLlamaRuntime"]
