"""What each kind of served model loads as, and which endpoints need which kind.

A kind is checked before it loads (:class:`Plan`: its directory, backend, options and estimated memory) and then
loaded (a runtime with ``close()``). ``chat`` loads as an :class:`~..runtime.local.ExLlamaRuntime` whose driver runs
in an engine process of its own; another kind (an embedding or rerank model) is one more entry of :data:`LOADERS`,
and the endpoints that need it are entries of :data:`ENDPOINT_KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .footprint import Footprint, estimate
from .model_config import ModelSpec


@dataclass(frozen=True)
class Plan:
    """A model checked before it loads: its directory, resolved backend and options, and its estimated memory."""

    model: Any
    backend: str
    options: Any
    estimate: Footprint
    context_length: int


def plan_chat(spec: ModelSpec) -> Plan:
    """A chat model's plan: the directory inspected, the backend resolved, a server's load options.

    In a server of several models an exllamav3 cache is sized, not taken from the free memory: ``cache_size`` as
    given, else the model's context (whole pages).
    """
    from ..runtime.local.registry import plan_load, serving_options

    options = serving_options(spec.model_dir, spec.backend, spec.options)
    model, backend_cls, opts = plan_load(spec.model_dir, spec.backend, None, None, None, options)
    context = min(opts.max_seq_len or model.context_length, model.context_length)
    if getattr(opts, "cache_size", None) == "auto":
        opts = opts.model_copy(update={"cache_size": max(256, -(-context // 256) * 256)})
    return Plan(model, backend_cls.name, opts, estimate(model, backend_cls.name, opts, spec.engines), context)


def load_chat(spec: ModelSpec, plan: Plan) -> Any:
    """A chat model loaded in its own engine process(es)."""
    from ..runtime.local import ExLlamaRuntime

    return ExLlamaRuntime(
        plan.model.path,
        plan.backend,
        engine="process",
        engines=spec.engines,
        **plan.options.model_dump(exclude_none=True),
    )


LOADERS: dict[str, tuple[Callable[[ModelSpec], Plan], Callable[[ModelSpec, Plan], Any]]] = {
    "chat": (plan_chat, load_chat)
}
"""Each kind of model: how it is checked before it loads, and how it loads (a runtime with ``close()``)."""
ENDPOINT_KINDS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/exllama/generate": "chat",
}
"""The kind of model an endpoint needs (paths not here take any kind)."""


__all__ = ["ENDPOINT_KINDS", "LOADERS", "Plan", "load_chat", "plan_chat"]
