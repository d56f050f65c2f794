"""The HTTP app over any Runtime, assembled: the guard, the lifespan, the error answers, the routers.

``create_app(runtime)`` serves the OpenAI-compatible endpoints for third-party clients (``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``: :mod:`.openai`; ``/v1/rerank``: :mod:`.rerank`),
the native endpoints RemoteRuntime speaks
(``/v1/exllama/{info,tokenizer,generate}``: :mod:`.native`) and ``/health``. Every error is an OpenAI-shaped
error object with the status of the one error table (on the native endpoints, the contract's wire form);
a client that disconnects cancels its generation at the next step.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import ExLlamaIntegrationsError, MissingDependencyError

try:
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    raise MissingDependencyError("fastapi", "serve", "the HTTP server") from None

from ..chat.formats import find_format
from ..contract import wire
from ..contract.api import Runtime
from . import metrics, native
from .anthropic import endpoint as anthropic_messages
from .anthropic import errors as anthropic_errors
from .decisions.endpoint import router as decisions_router
from .guard import Guard, error_body, error_response, validation_response
from .metrics import Metrics
from .openai import completions, embeddings, models, tokenize
from .openai import endpoint as chat
from .openai.protocol import ALL_FIELDS
from .openai.protocol.embeddings import EmbeddingBody
from .rerank import endpoint as rerank
from .rerank.protocol import RerankBody
from .responses import endpoint as responses
from .state import ServeLimits, ServeState, state_of
from .streaming import ClientGone

logger = logging.getLogger("exllama_integrations.serve")
FIELDS = sorted({*ALL_FIELDS, *EmbeddingBody.model_fields, *RerankBody.model_fields})
"""Every request field name of the OpenAI-shaped endpoints (for "did you mean" on a misspelt one)."""

__all__ = ["ServeLimits", "create_app", "model_routers"]

GUARD_SHAPES = {"/v1/messages": anthropic_errors.error_body}
"""What the guard refuses under a path prefix, in that API's error shape (Anthropic's, for the Messages API)."""


def _native(request: Request) -> bool:
    return request.url.path.startswith("/v1/exllama/")


def model_routers() -> list[APIRouter]:
    """The routers of a model's endpoints (every endpoint but ``/health``).

    A server of several models sends a request for one of these to the model it names.
    """
    return [
        models.router,
        completions.router,
        chat.router,
        embeddings.router,
        rerank.router,
        decisions_router,
        tokenize.router,
        native.router,
        metrics.router,
        anthropic_messages.router,
        responses.router,
    ]


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
    metrics: Metrics | None = None,
    guard: bool = True,
) -> FastAPI:
    """The HTTP app serving ``runtime`` (which it does not close unless ``on_shutdown`` does).

    ``freeze_gc``: when the app starts, every object alive then (the loaded model, torch, the libraries) is
    moved out of the garbage collector's scans (``gc.freeze()``), as a server that owns its process should.
    A full collection of a process with torch and ExLlama loaded scans half a million objects or more and
    holds the GIL for a quarter of a second or more, pausing every generation in flight (seen on the H200
    under load: 239 and 309 ms). ``exllama-integrations serve`` and the Ray replicas turn it on.
    ``chat_template``: a template that replaces the model's own on the chat endpoint.
    ``tool_format``: the tool-call format every chat request is read and written in (a name of
    ``chat.formats.FORMATS``), instead of the one found in the model, as ``tool_format=`` does in process.
    ``metrics``: the model's series in a server's metric families (a server of several models); ``guard=False``: no
    :class:`~.guard.Guard` of its own (such a server's guard stands in front of every model's app).

    Raises:
        InvalidSettingsError: ``tool_format`` names no format (the message lists those there are).
    """
    if tool_format is not None:
        find_format(None, tool_format)
    info = runtime.model_info()
    state = ServeState(
        runtime,
        served_model_name or info.name,
        limits or ServeLimits(),
        chat_template=chat_template,
        tool_format=tool_format,
        created=int(time.time()),
        metrics=metrics,
    )

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if freeze_gc:
            gc.collect()
            gc.freeze()
            logger.info("%d objects alive at startup are left out of garbage collection", gc.get_freeze_count())
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="exllama-integrations", version="1", lifespan=lifespan)  # type: ignore[arg-type]
    app.state.serve = state
    app.state.runtime = runtime

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(list(exc.errors()), FIELDS)  # 400, as OpenAI answers a bad body

    @app.exception_handler(ExLlamaIntegrationsError)
    async def _typed(request: Request, exc: ExLlamaIntegrationsError) -> Response:
        if _native(request):
            return Response(wire.dumps_error(exc), status_code=type(exc).status, media_type="application/json")
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is there to read it; the generation was cancelled

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            error_body(str(exc.detail), "invalid_request_error", code=code), exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _untyped(request: Request, exc: Exception) -> Response:
        return error_response(exc)  # logged with its traceback; the client gets OpenAI's error object, 500

    if guard:
        app.add_middleware(
            Guard,
            api_key=api_key,
            max_body_bytes=state.limits.max_body_bytes,
            body_timeout=state.limits.body_timeout,
            shapes=GUARD_SHAPES,
        )

    @app.get("/health", tags=["server"])
    async def health(request: Request) -> Response:
        """Whether the runtime serves (``ok``, 200), was closed, or cannot take requests now.

        ``unavailable`` (503) comes with the ``reason`` (its engine process died and is starting again); also
        requests in flight, which server instance answers and, behind Ray's ingress, the requests each model
        replica answered (``replicas``).
        """
        s = state_of(request.app)
        body: dict[str, Any] = {"status": "ok", "model": s.name, "in_flight": s.pending, "instance": s.instance}
        placement = getattr(s.runtime, "placement", None)
        if callable(placement):  # Ray's ingress: requests answered by each model replica
            body["replicas"] = placement()
        check = getattr(s.runtime, "health", None)
        problem = check() if callable(check) else None
        if s.runtime.closed:
            body["status"] = "closed"
        elif problem is not None:
            body.update(status="unavailable", reason=problem)
            return JSONResponse(body, 503)
        return JSONResponse(body)

    for router in model_routers():
        app.include_router(router)
    return app
