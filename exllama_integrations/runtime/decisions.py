"""Which object answers decision questions for a runtime: the runtime itself, or the decider made for it.

A runtime with the :class:`~..contract.decisions.Decides` capability answers them itself; an in-process
:class:`~.local.ExLlamaRuntime` through :class:`~.local.decisions.LocalDecider` (its backend scores the labels); a
:class:`~.remote.RemoteRuntime` through its server's ``/v1/decisions``. Any other runtime is refused, typed.
"""

from __future__ import annotations

import sys
from typing import Any

from ..contract.decisions import Decides
from ..errors import UnsupportedTaskError


def decider(runtime: Any) -> Decides:
    """What answers decision questions for ``runtime``.

    Raises:
        UnsupportedTaskError: the runtime cannot answer them (an embedding model's, or another library's runtime).
    """
    if isinstance(runtime, Decides):
        return runtime
    from .local.runtime import ExLlamaRuntime

    if isinstance(runtime, ExLlamaRuntime):
        from .local.decisions import local_decider

        return local_decider(runtime)
    remote = sys.modules.get("exllama_integrations.runtime.remote.runtime")  # loaded if such a runtime exists
    if remote is not None and isinstance(runtime, remote.RemoteRuntime):
        from .remote.decisions import remote_decider

        return remote_decider(runtime)
    info = getattr(runtime, "model_info", None)
    name = info().name if callable(info) else type(runtime).__name__
    raise UnsupportedTaskError(
        f"{name!r} cannot answer decision questions: they need a text-generation model's logits, in process "
        "(ExLlamaRuntime) or on an exllama-integrations server (base_url=)."
    )


__all__ = ["decider"]
