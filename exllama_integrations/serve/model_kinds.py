"""What each kind of served model loads as, and which endpoints need which kind.

A kind is checked before it loads (:class:`Plan`: its directory, backend, options and estimated memory) and then
loaded (a runtime with ``close()``). ``chat`` loads as an :class:`~..runtime.local.ExLlamaRuntime` whose driver runs
in an engine process of its own; ``embedding`` and ``rerank`` as an :class:`~..runtime.local.EmbeddingRuntime`, whose
batches run on a worker thread of the server. A model's kind is its entry's, else what its files say
(:func:`kind_of`); the endpoints that need a kind are :data:`ENDPOINT_KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .footprint import Footprint, estimate, estimate_weights
from .model_config import ModelSpec

TASKS = {"chat": "generate", "embedding": "embed", "rerank": "rerank"}
"""Each kind's task, as the pooling config names it (:func:`~..model.pooling.detect_task`)."""


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


def plan_pooling(spec: ModelSpec) -> Plan:
    """An embedding or rerank model's plan: the directory inspected, its pooling read, the backend resolved."""
    from ..backends.base import build_options
    from ..backends.pooling import resolve_pooling_backend
    from ..model.directory import ModelDirectory
    from ..model.hub import resolve_model_dir
    from ..model.pooling import read_pooling

    model = ModelDirectory.inspect(resolve_model_dir(spec.model_dir))
    pooling = read_pooling(model, TASKS[kind_of(spec, model)])
    cls = resolve_pooling_backend(spec.backend, model, pooling)
    opts = cls.resolve_options(build_options(cls.Options, cls.name, spec.options))  # type: ignore[arg-type]
    context = min(opts.max_seq_len or pooling.max_tokens, pooling.max_tokens)  # what it reads (max_seq_length)
    return Plan(model, cls.name, opts, estimate_weights(model, cls.name, opts), context)


def load_pooling(spec: ModelSpec, plan: Plan) -> Any:
    """An embedding or rerank model, loaded in the server's process (its batches on a worker thread)."""
    from ..runtime.local import EmbeddingRuntime

    options = plan.options.model_dump(exclude_none=True)
    return EmbeddingRuntime(plan.model.path, plan.backend, task=TASKS[kind_of(spec, plan.model)], **options)


def kind_of(spec: ModelSpec, model: Any = None) -> str:
    """A model's kind: its entry's, else what its directory's files say (``model``: the inspected directory)."""
    if spec.kind is not None:
        return spec.kind
    from ..model.directory import ModelDirectory
    from ..model.hub import resolve_model_dir
    from ..model.pooling import detect_task

    task = detect_task(model or ModelDirectory.inspect(resolve_model_dir(spec.model_dir)))
    return next(kind for kind, t in TASKS.items() if t == task)


LOADERS: dict[str, tuple[Callable[[ModelSpec], Plan], Callable[[ModelSpec, Plan], Any]]] = {
    "chat": (plan_chat, load_chat),
    "embedding": (plan_pooling, load_pooling),
    "rerank": (plan_pooling, load_pooling),
}
"""Each kind of model: how it is checked before it loads, and how it loads (a runtime with ``close()``)."""
ENDPOINT_KINDS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/exllama/generate": "chat",
    "/v1/embeddings": "embedding",
    "/v1/exllama/embed": "embedding",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/exllama/rerank": "rerank",
}
"""The kind of model an endpoint needs (paths not here take any kind)."""


__all__ = ["ENDPOINT_KINDS", "LOADERS", "Plan", "kind_of", "load_chat", "load_pooling", "plan_chat", "plan_pooling"]
