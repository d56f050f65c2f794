"""The in-process Runtime: a model loaded in this process (registry, run, runtime)."""

from .runtime import ExLlamaRuntime

__all__ = ["ExLlamaRuntime"]
