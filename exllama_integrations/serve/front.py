"""The HTTP front of several models: the request's ``model`` picks which model's app answers it.

``create_front(registry)`` is one ASGI app: the :class:`~.guard.Guard` (key, body limits, the log line), then for
every endpoint a model serves (:func:`~.app.model_routers`: chat, completions, Messages, Responses, tokenize, the
native endpoints) the model named by the query's ``model`` or else the JSON body's (the first model when neither
names one) is leased from the :class:`~.models.ModelRegistry` (loaded first if it is not; the request waits) and the
request handed to that model's own app (:func:`~.app.create_app` over its runtime) until its response has ended. An
Ollama-style ``keep_alive`` (query or body) is taken out of the body there and applies to that model. What the front
answers itself: ``/v1/models`` (every model, with its state), ``/health``, ``/metrics`` and ``/v1/loads`` (every
model's series, labelled ``model_name``). A model that cannot be had is refused before anything else runs, in the
error shape of the API asked (404 unknown, 400 wrong kind, 503 no room or a failed load).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..contract import wire
from ..errors import ExLlamaIntegrationsError, InvalidSettingsError
from .anthropic import errors as anthropic_errors
from .app import GUARD_SHAPES, ServeLimits, create_app, model_routers
from .guard import Guard, error_body, error_response
from .metrics import exposition_response
from .model_config import parse_duration
from .models import Entry, ModelRegistry
from .openai.protocol.models import ServedModelCard, ServedModelList

logger = logging.getLogger("exllama_integrations.serve")

INLINE_JSON_BYTES = 256 * 1024
"""Bodies up to this size are read for their ``model`` on the event loop; larger ones on a worker thread."""


def _model_paths() -> dict[str, frozenset[str]]:
    """The paths a model's app answers, each with its methods, less what the front answers itself.

    A catch-all route (the Messages API's answer to an unknown path under it) is the front's to answer: a stray
    request loads no model.
    """
    out: dict[str, set[str]] = {}
    for router in model_routers():
        for route in router.routes:
            path = getattr(route, "path", "")
            if path.startswith("/v1/models") or path in ("/metrics", "/v1/loads") or "{" in path:
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
    """The ASGI app behind the guard: the front's own routes, or the leased model's app (see the module docstring)."""

    def __init__(self, registry: ModelRegistry, control: FastAPI) -> None:
        self.registry, self.control = registry, control
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
        except (ValueError, RecursionError) as e:  # not JSON, or a bad keep_alive
            bad = e if isinstance(e, InvalidSettingsError) else InvalidSettingsError(f"the body is not valid JSON: {e}")
            await typed_answer(path, bad)(scope, receive, send)
            return
        except ExLlamaIntegrationsError as e:
            await typed_answer(path, e)(scope, receive, send)
            return
        try:
            await lease.app(scope, _replayed(body, receive), send)
        finally:
            lease.release()


def _read_body(body: bytes) -> tuple[str | None, Any, bytes]:
    """A JSON body's ``model`` and ``keep_alive``, and the body without ``keep_alive`` (the model's app knows none).

    Raises:
        ValueError: the body is not JSON.
    """
    data = json.loads(body)
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
) -> Any:
    """The HTTP app over every model of ``registry`` (see the module docstring).

    It loads the pinned models as it starts, and unloads every model as it stops.
    """
    limits = limits or ServeLimits()
    started = int(time.time())

    def app_for(e: Entry, runtime: Any) -> Any:
        return create_app(
            runtime,
            served_model_name=e.name,
            limits=limits,
            chat_template=e.spec.chat_template,
            tool_format=e.spec.tool_format,
            metrics=e.metrics,
            guard=False,
        )

    registry.app_for = app_for

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        if freeze_gc:
            gc.collect()
            gc.freeze()
        yield
        await registry.close()

    control = FastAPI(title="exllama-integrations", version="1", lifespan=lifespan)  # type: ignore[arg-type]

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
        """``ok`` while the server answers (a model loads on its first request); each model's state."""
        return JSONResponse({"status": "ok", "models": {e.name: e.state for e in registry.entries.values()}})

    @control.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Every model's metrics in Prometheus' text format (labelled ``model_name``)."""
        return exposition_response(registry.families)

    @control.get("/v1/loads", include_in_schema=False)
    async def loads() -> JSONResponse:
        """SGLang's load report over every model (what SMG reads)."""
        return JSONResponse(registry.families.loads())

    @control.exception_handler(404)
    async def _missing(request: Request, exc: Any) -> JSONResponse:
        return JSONResponse(
            error_body(f"no endpoint {request.url.path}", "invalid_request_error", code="not_found"), 404
        )

    return Guard(
        Dispatch(registry, control),
        api_key=api_key,
        max_body_bytes=limits.max_body_bytes,
        body_timeout=limits.body_timeout,
        shapes=GUARD_SHAPES,
    )


__all__ = ["create_front", "typed_answer"]
