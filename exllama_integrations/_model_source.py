"""Where a framework class's model is: exactly one of ``model_dir=``, ``base_url=`` and ``runtime=``.

Decided once for every class built on a runtime (``_adapter.ExLlamaConfig`` for the LLM and chat classes,
``_retrieval.RetrievalConfig`` for the embedding and rerank classes): the check that one place is given, and
the runtime of a server's model (``base_url=``, with ``server_model`` and ``api_key``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import InvalidSettingsError

if TYPE_CHECKING:
    from .runtime.remote import RemoteRuntime


def check_one_place(config: Any) -> None:
    """Raise unless exactly one of ``config.model_dir``, ``config.base_url`` and ``config.runtime`` is set.

    Raises:
        InvalidSettingsError: none of them, or more than one (named).
    """
    given = [n for n in ("model_dir", "base_url", "runtime") if getattr(config, n)]
    if len(given) != 1:
        raise InvalidSettingsError(
            "pass exactly one of model_dir='path/to/model', base_url='http://127.0.0.1:8000' or runtime=..."
            + (f" (got {', '.join(given)})" if given else "")
        )


def server_runtime(config: Any) -> RemoteRuntime:
    """The shared runtime of ``config.base_url``'s model (``config.server_model``; None: the server's first)."""
    from .runtime.remote import RemoteRuntime

    key = config.api_key.get_secret_value() if config.api_key is not None else None
    return RemoteRuntime.shared(config.base_url, api_key=key, model=config.server_model)


__all__ = ["check_one_place", "server_runtime"]
