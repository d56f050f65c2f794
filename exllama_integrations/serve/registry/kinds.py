"""What each kind of served model loads as, and which endpoints need which kind.

A kind is checked before it loads (:class:`Plan`: its directory, backend, options and estimated memory) and then
loaded (a runtime with ``close()``). ``chat`` loads as an :class:`~...runtime.local.ExLlamaRuntime` whose driver runs
in an engine process of its own; ``embedding`` and ``rerank`` as an :class:`~...runtime.local.EmbeddingRuntime`, whose
batches run on a worker thread of the server. A model's kind is its entry's, else what its files say
(:func:`kind_of`); the endpoints that need a kind are :data:`ENDPOINT_KINDS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidSettingsError
from ...model.pooling import KIND_OF_TASK
from ...model.pooling import TASK_OF_KIND as TASKS
from .config import ModelSpec
from .footprint import Footprint, estimate, estimate_weights


@dataclass(frozen=True)
class Plan:
    """A model checked before it loads: its directory, resolved backend and options, and its estimated memory.

    ``load``: the resolved load itself (:class:`~...runtime.local.registry.LoadPlan`, or an embedding model's
    :class:`~...runtime.local.embedding.PoolingPlan`), handed to the runtime as it is: the directory is inspected once.
    """

    model: Any
    backend: str
    options: Any
    estimate: Footprint
    context_length: int
    load: Any = None


def plan_chat(spec: ModelSpec, model: Any = None, *, alone: bool = False) -> Plan:
    """A chat model's plan: the directory inspected (``model``: already), the backend resolved, a server's options.

    In a server of several models an exllamav3 cache is sized, not taken from the free memory: ``cache_size`` as
    given, else the model's context (whole pages). A model served ``alone`` (``serve DIR``) keeps ``"auto"``: its
    cache takes the free memory.
    """
    from ...runtime.local.registry import plan_serving

    load = plan_serving(spec.model_dir, spec.backend, spec.options, model=model)
    model, opts = load.model, load.options
    context = min(opts.max_seq_len or model.context_length, model.context_length)
    if not alone and getattr(opts, "cache_size", None) == "auto":
        opts = opts.model_copy(update={"cache_size": max(256, -(-context // 256) * 256)})
        load = load._replace(options=opts)
    name = load.backend.name
    return Plan(model, name, opts, estimate(model, name, opts, spec.engines), context, load)


def load_chat(spec: ModelSpec, plan: Plan, *, engine: str = "process") -> Any:
    """A chat model loaded from its plan in its own engine process(es) (``engine="thread"``: in this one)."""
    from ...runtime.local import ExLlamaRuntime

    return ExLlamaRuntime(plan.model.path, plan.backend, engine=engine, engines=spec.engines, plan=plan.load)


def plan_pooling(spec: ModelSpec, model: Any = None, *, alone: bool = False) -> Plan:
    """An embedding or rerank model's plan: its directory (``model``: inspected already), pooling, backend, options."""
    from ...runtime.local.embedding import plan_pooling as plan

    load = plan(spec.model_dir, spec.backend, TASKS[kind_of(spec, model)], spec.options, model=model)
    model, name, opts = load.model, load.backend.name, load.options
    limit = load.pooling.max_tokens  # what it reads (max_seq_length), not the position table's size
    context = min(opts.max_seq_len or limit, limit)
    return Plan(model, name, opts, estimate_weights(model, name, opts), context, load)


def load_pooling(spec: ModelSpec, plan: Plan, *, engine: str = "process") -> Any:
    """An embedding or rerank model loaded from its plan, in the server's process (its batches on a worker thread)."""
    from ...runtime.local import EmbeddingRuntime

    return EmbeddingRuntime(plan.model.path, plan.backend, plan=plan.load)


def kind_of(spec: ModelSpec, model: Any = None) -> str:
    """A model's kind: its entry's, else what its directory's files say (``model``: the inspected directory)."""
    if spec.kind is not None:
        return spec.kind
    from ...model.pooling import detect_task

    task = detect_task(model or inspect(spec))
    return KIND_OF_TASK[task]


def inspect(spec: ModelSpec) -> Any:
    """The model's directory, inspected (a Hub id fetched first)."""
    from ...model.directory import ModelDirectory
    from ...model.hub import resolve_model_dir

    return ModelDirectory.inspect(resolve_model_dir(spec.model_dir))


Planner = Callable[..., Plan]
"""``(spec, model)``: a model's :class:`Plan` (``model``: its directory inspected already, or None)."""
Loader = Callable[..., Any]
"""``(spec, plan)``: the model loaded from its plan (a runtime with ``close()``)."""


def planned(
    spec: ModelSpec, loaders: Mapping[str, tuple[Planner, Loader]] | None = None, **how: Any
) -> tuple[ModelSpec, Plan]:
    """``spec`` with its kind (found from its files where it names none) and its plan, the directory inspected once.

    ``how``: what the kind's planner is told (``alone=True``: a model served alone).

    Raises:
        InvalidSettingsError: no model of that kind can be served here; and the plan's own refusals.
    """
    loaders = LOADERS if loaders is None else loaders
    model, kind = None, spec.kind
    if kind is None:
        model = inspect(spec)
        kind = kind_of(spec, model)
        spec = dataclasses.replace(spec, kind=kind)
    if kind not in loaders:
        raise InvalidSettingsError(f"model {spec.name!r}: no model of kind {kind!r} can be served here.")
    return spec, loaders[kind][0](spec, model, **how)


LOADERS: dict[str, tuple[Planner, Loader]] = {
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


__all__ = [
    "ENDPOINT_KINDS",
    "KIND_OF_TASK",
    "LOADERS",
    "Plan",
    "kind_of",
    "load_chat",
    "load_pooling",
    "plan_chat",
    "plan_pooling",
    "planned",
]
