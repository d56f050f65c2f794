"""The engine process: a backend and its driver in a process of their own (``engine="process"``), and its client."""

from .backend import EngineBackend
from .routing import PrefixRouter, block_hashes

__all__ = ["EngineBackend", "PrefixRouter", "block_hashes"]
