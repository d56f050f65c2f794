"""The HTTP app of every server: the request's ``model`` picks which model's app answers it, of one model or several.

``create_front(registry)`` is the one app every way of serving builds (``serve DIR``, ``serve DIR DIR ...``,
``serve --config``, Ray's ingress); ``create_app(runtime)``, a runtime loaded in this process, is the same app over a
registry of that one model (:meth:`~.registry.models.ModelRegistry.of_loaded`), its id the served name (default:
the model's own). In front, the :class:`~.guard.Guard` (key, body limits, the log line); then for every endpoint a
model serves (:func:`~.model_app.model_routers`: chat, completions, embeddings, rerank, Messages, Responses,
tokenize, decisions, the native endpoints) the model named by the query's ``model`` or else the JSON body's (the
first model when neither names one) is leased from the :class:`~.registry.models.ModelRegistry` (loaded first if it
is not; the request waits) and the request handed to that model's own app (:func:`~.model_app.model_app` over its
runtime) until its response has ended. An Ollama-style ``keep_alive`` (query or body) is taken out of the body there
and applies to that model. What the app answers itself: ``/v1/models`` (every model, with its state), ``/health``,
``/metrics`` and ``/v1/loads`` (every model's series, labelled ``model_name``), and what no model's endpoint takes
(404, or 405 for a method an endpoint does not take). A model that cannot be had is refused before anything else
runs, in the error shape of the API asked (404 unknown, 400 wrong kind, 503 no room or a failed load).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import parse_qs

from ..errors import ExLlamaIntegrationsError, MissingDependencyError

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    raise MissingDependencyError("fastapi", "serve", "the HTTP server") from None

from ..contract import wire
from ..contract.api import Runtime
from .anthropic import errors as anthropic_errors
from .guard import Guard, error_response
from .metrics import exposition_response
from .model_app import GUARD_SHAPES, add_error_answers, model_app, model_routers
from .openai.protocol.models import ServedModelCard, ServedModelList
from .registry.config import parse_duration
from .registry.entry import Entry
from .registry.models import ModelRegistry
from .state import ServeLimits

logger = logging.getLogger("exllama_integrations.serve")

INLINE_JSON_BYTES = 256 * 1024
"""Bodies up to this size are read for their ``model`` on the event loop; larger ones on a worker thread."""


def _model_paths() -> dict[str, frozenset[str]]:
    """The paths a model's app answers, each with its methods.

    A catch-all route (the Messages API's answer to an unknown path under it) is the front's to answer: a stray
    request loads no model.
    """
    out: dict[str, set[str]] = {}
    for router in model_routers():
        for route in router.routes:
            path = getattr(route, "path", "")
            if "{" in path:
                continue
            out.setdefault(path, set()).update(getattr(route, "methods", None) or ())
    return {path: frozenset(methods) for path, methods in out.items()}


def typed_answer(path: str, e: BaseException) -> Response:
    """A refusal in the shape of the API ``path`` belongs to (native: the contract's wire form)."""
    if path.startswith("/v1/exllama/") and isinstance(e, ExLlamaIntegrationsError):
        headers = {"Retry-After": "1"} if type(e).status == 503 else None
        return Response(wire.dumps_error(e), type(e).status, headers=headers, media_type="application/json")
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic_errors.typed_response(e)
    return error_response(e)


def _first(query: dict[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    return values[0] if values else None


class Dispatch:
    """ASGI middleware behind the guard: a model's endpoint goes to the leased model's app, the rest to the front."""

    def __init__(self, app: Any, registry: ModelRegistry) -> None:
        self.registry, self.control = registry, app
        self.paths = _model_paths()

    def _for_a_model(self, path: str, method: str) -> bool:
        """Whether a model's app answers ``method`` on ``path`` (anything else, the front answers or refuses)."""
        return method in self.paths.get(path, ())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self._for_a_model(path, scope.get("method", "")):
            await self.control(scope, receive, send)
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        model, keep = _first(query, "model"), _first(query, "keep_alive")
        body = b""
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            body, receive = await _whole_body(receive)
        try:
            if body[:1] == b"{":
                if len(body) <= INLINE_JSON_BYTES:
                    named, kept, body = _read_body(body)
                else:
                    named, kept, body = await asyncio.to_thread(_read_body, body)
                model = model if model is not None else named
                keep = keep if keep is not None else kept
            keep_alive = None if keep is None else parse_duration(keep, "keep_alive")
            entry = self.registry.entry(model)
            scope.setdefault("state", {})["model"] = entry.name
            self.registry.check_kind(entry, path)
            lease = await self.registry.acquire(entry.name, keep_alive)
        except ExLlamaIntegrationsError as e:  # no such model, the wrong kind, no room, a bad keep_alive
            await typed_answer(path, e)(scope, receive, send)
            return
        try:
            await lease.app(scope, _replayed(body, receive), send)
        finally:
            lease.release()


def _read_body(body: bytes) -> tuple[str | None, Any, bytes]:
    """A JSON body's ``model`` and ``keep_alive``, and the body without ``keep_alive`` (the model's app knows none).

    A body that is not JSON names nothing: the model's app answers it, as it answers any bad body.
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None, None, body
    if not isinstance(data, dict):
        return None, None, body
    model = None if data.get("model") is None else str(data["model"])
    if "keep_alive" not in data:
        return model, None, body
    keep = data.pop("keep_alive")
    return model, keep, json.dumps(data).encode()


async def _whole_body(receive: Any) -> tuple[bytes, Any]:
    """The request's body (the guard has read it whole), and a ``receive`` for what comes after (a disconnect)."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), _replayed(b"", receive, gone=message)
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), receive


def _replayed(body: bytes, receive: Any, gone: dict[str, Any] | None = None) -> Any:
    sent = [False]

    async def replay() -> dict[str, Any]:
        if not sent[0]:
            sent[0] = True
            if gone is not None:
                return gone
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # type: ignore[no-any-return]

    return replay


def card(e: Entry, raw: dict[str, Any], created: int) -> ServedModelCard:
    """A model's card: its state, and once loaded what its app says of it."""
    state = e.server_state()
    info = None if state is None else state.info
    context = raw["context_length"] if info is None else info.context_length
    backend = raw["backend"] if info is None else info.backend
    return ServedModelCard(
        created=created if state is None else state.created,
        max_model_len=context,
        tool_format=e.spec.tool_format if info is None else info.tool_format,
        **{**raw, "context_length": context, "backend": backend},
    )


def create_front(
    registry: ModelRegistry,
    *,
    api_key: str | None = None,
    limits: ServeLimits | None = None,
    freeze_gc: bool = False,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The HTTP app over every model of ``registry`` (see the module docstring).

    It loads the pinned models as it starts (those not loaded yet), and unloads every model as it stops, then calls
    ``on_shutdown``. ``freeze_gc``: when the app starts, every object alive then (the loaded models, torch, the
    libraries) is moved out of the garbage collector's scans (``gc.freeze()``), as a server that owns its process
    should: a full collection of a process with torch and ExLlama loaded scans half a million objects or more and holds
    the GIL for a quarter of a second or more, pausing every generation in flight (seen on the H200 under load: 239
    and 309 ms). ``exllama-integrations serve`` and the Ray ingress turn it on.

    A registry of one model also puts that model's server state on the app (``app.state.serve``, ``.runtime``).
    """
    limits = limits or ServeLimits()
    started = int(time.time())
    instance = uuid.uuid4().hex[:12]

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        if freeze_gc:
            gc.collect()
            gc.freeze()
            logger.info("%d objects alive at startup are left out of garbage collection", gc.get_freeze_count())
        yield
        await registry.close()
        if on_shutdown is not None:
            on_shutdown()

    control = FastAPI(title="exllama-integrations", version="1", lifespan=lifespan)  # type: ignore[arg-type]
    control.state.registry = registry

    def app_for(e: Entry, runtime: Any) -> Any:
        app = model_app(
            runtime,
            served_model_name=e.name,
            limits=limits,
            chat_template=e.spec.chat_template,
            tool_format=e.spec.tool_format,
            metrics=e.metrics,
        )
        if len(registry.entries) == 1:
            control.state.serve, control.state.runtime = app.state.serve, runtime
        return app

    registry.app_for = app_for
    add_error_answers(control)

    @control.exception_handler(ExLlamaIntegrationsError)
    async def _typed(request: Request, exc: ExLlamaIntegrationsError) -> Response:
        return typed_answer(request.url.path, exc)

    @control.get("/v1/models", response_model=ServedModelList, tags=["openai"])
    async def models() -> ServedModelList:
        """Every model served, with its state (loaded, loading, unloaded), pinning, kind, keep_alive and memory."""
        raw = registry.cards()
        return ServedModelList(data=[card(registry.entries[r["id"]], r, started) for r in raw])

    @control.get("/v1/models/{model_id:path}", response_model=ServedModelCard, tags=["openai"])
    async def model(model_id: str) -> ServedModelCard:
        """One model's card (404 naming the models served, for any other)."""
        e = registry.entry(model_id)
        return card(e, next(r for r in registry.cards() if r["id"] == e.name), started)

    @control.get("/health", tags=["server"])
    async def health() -> JSONResponse:
        """Whether every loaded model serves (``ok``, 200), or one cannot take requests now (``unavailable``, 503).

        ``unavailable`` comes with the ``reason`` (a model's engine process died and is starting again); also each
        model's state (a model loads on its first request), the work in flight, which server instance answers and,
        behind Ray's ingress, the requests each model replica answered (``replicas``).
        """
        return health_answer(registry, instance)

    @control.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Every model's metrics in Prometheus' text format (labelled ``model_name``)."""
        return exposition_response(registry.families)

    @control.get("/v1/loads", include_in_schema=False)
    async def loads() -> JSONResponse:
        """SGLang's load report over every model (what SMG reads)."""
        return JSONResponse(registry.families.loads())

    for router in model_routers():  # in /docs; a request for one goes to a model's app (Dispatch), not here
        control.router.routes.extend(router.routes)
    control.add_middleware(Dispatch, registry=registry)
    control.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=limits.max_body_bytes,
        body_timeout=limits.body_timeout,
        shapes=GUARD_SHAPES,
    )
    return control


def health_answer(registry: ModelRegistry, instance: str) -> JSONResponse:
    """``/health``: the same answer for one model and several (see ``create_front``'s ``health``)."""
    loaded = [e for e in registry.entries.values() if e.state == "loaded" and e.runtime is not None]
    states = [s for s in (e.server_state() for e in loaded) if s is not None]
    body: dict[str, Any] = {
        "status": "ok",
        "model": registry.default,
        "models": {e.name: e.state for e in registry.entries.values()},
        "in_flight": sum(s.pending for s in states),
        "instance": instance,
    }
    replicas: Counter[str] = Counter()
    for e in loaded:
        placement = getattr(e.runtime, "placement", None)
        if callable(placement):  # Ray's ingress: requests answered by each model replica
            replicas.update(placement())
    if replicas:
        body["replicas"] = dict(replicas)
    for e in loaded:
        check = getattr(e.runtime, "health", None)
        problem = check() if callable(check) else None
        if e.runtime.closed:
            body["status"] = "closed"
        elif problem is not None:
            body.update(status="unavailable", reason=f"model {e.name!r}: {problem}")
            return JSONResponse(body, 503)
    return JSONResponse(body)


def create_app(
    runtime: Runtime,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    limits: ServeLimits | None = None,
    on_shutdown: Callable[[], None] | None = None,
    freeze_gc: bool = False,
    chat_template: str | None = None,
    tool_format: str | None = None,
) -> FastAPI:
    """The HTTP app serving ``runtime`` (which it does not close unless ``on_shutdown`` does).

    ``served_model_name``: the model's id (default: its own name; a request may name either).
    ``chat_template``: a template that replaces the model's own on the chat endpoint.
    ``tool_format``: the tool-call format every chat request is read and written in (a name of
    ``chat.formats.FORMATS``), instead of the one found in the model, as ``tool_format=`` does in process.
    ``freeze_gc``: see :func:`create_front`.

    Raises:
        InvalidSettingsError: ``tool_format`` names no format (the message lists those there are).
    """
    entry = {"chat_template": chat_template, "tool_format": tool_format}
    registry = ModelRegistry.of_loaded((runtime, served_model_name, entry))
    app = create_front(registry, api_key=api_key, limits=limits, freeze_gc=freeze_gc, on_shutdown=on_shutdown)
    registry.load_pinned_now()  # loaded already: its app made now (``app.state.serve``)
    return app


__all__ = ["ServeLimits", "create_app", "create_front", "typed_answer"]
