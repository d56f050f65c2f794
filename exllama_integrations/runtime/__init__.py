"""Runtimes: shared conveniences, in process, over HTTP, and the backends below them.

Runtimes: the conveniences every runtime shares (:mod:`.base`), the in-process runtime (:mod:`.local`), the HTTP
client runtime (:mod:`.remote`), and the backends below them (:mod:`.backends`).

Nothing here imports torch or a backend until a model is loaded.
"""

from .base import RuntimeBase
from .local import ExLlamaRuntime
from .local.run import LocalStream

__all__ = ["ExLlamaRuntime", "LocalStream", "RuntimeBase"]
