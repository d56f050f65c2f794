"""The runtime: one loaded model, its tokenizer, and generation shared by every adapter."""

from .model_dir import ModelDirectory
from .runtime import ExLlamaRuntime, GenerationChunk, GenerationResult, GenerationStream, Timings, Usage
from .settings import GenerationSettings
from .streaming import IncrementalDetokenizer, StopStringMatcher
from .tokenizer import NativeTokenizer

__all__ = [
    "ExLlamaRuntime",
    "GenerationChunk",
    "GenerationResult",
    "GenerationSettings",
    "GenerationStream",
    "IncrementalDetokenizer",
    "ModelDirectory",
    "NativeTokenizer",
    "StopStringMatcher",
    "Timings",
    "Usage",
]
