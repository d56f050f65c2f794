"""One model's HTTP app: its endpoints over its runtime, with the error answers; the front sends it its requests.

``model_app(runtime)`` serves the OpenAI-compatible endpoints (``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``: :mod:`.openai`; ``/v1/rerank``: :mod:`.rerank`), the Messages and
Responses APIs, the native endpoints RemoteRuntime speaks (``/v1/exllama/{info,tokenizer,generate}``: :mod:`.native`)
and the decisions endpoint, each from :func:`model_routers` (the front answers ``/v1/models``, ``/health`` and
``/metrics`` over every model). Every error is an OpenAI-shaped error object with the
status of the one error table (on the native endpoints, the contract's wire form); a client that disconnects cancels
its generation at the next step. It has no guard, no ``/health`` and no lifespan of its own: every server, of one
model or several, is the app of :mod:`.app` over a registry (:mod:`.registry.models`), which owns those.
"""

from __future__ import annotations

import logging
import time

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
from . import native
from .anthropic import endpoint as anthropic_messages
from .anthropic import errors as anthropic_errors
from .decisions.endpoint import router as decisions_router
from .guard import error_body, error_response, validation_response
from .metrics import Metrics
from .openai import completions, embeddings, tokenize
from .openai import endpoint as chat
from .openai.protocol import ALL_FIELDS
from .openai.protocol.embeddings import EmbeddingBody
from .rerank import endpoint as rerank
from .rerank.protocol import RerankBody
from .responses import endpoint as responses
from .state import ServeLimits, ServeState
from .streaming import ClientGone

logger = logging.getLogger("exllama_integrations.serve")
FIELDS = sorted({*ALL_FIELDS, *EmbeddingBody.model_fields, *RerankBody.model_fields})
"""Every request field name of the OpenAI-shaped endpoints (for "did you mean" on a misspelt one)."""

__all__ = ["GUARD_SHAPES", "model_app", "model_routers"]

GUARD_SHAPES = {"/v1/messages": anthropic_errors.error_body}
"""What the guard refuses under a path prefix, in that API's error shape (Anthropic's, for the Messages API)."""


def _native(request: Request) -> bool:
    return request.url.path.startswith("/v1/exllama/")


def model_routers() -> list[APIRouter]:
    """The routers of a model's endpoints: the front sends a request for one of these to the model it names."""
    return [
        completions.router,
        chat.router,
        embeddings.router,
        rerank.router,
        decisions_router,
        tokenize.router,
        native.router,
        anthropic_messages.router,
        responses.router,
    ]


def model_app(
    runtime: Runtime,
    *,
    served_model_name: str | None = None,
    limits: ServeLimits | None = None,
    chat_template: str | None = None,
    tool_format: str | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """The app of one loaded model's endpoints over ``runtime`` (which it does not close).

    ``chat_template``: a template that replaces the model's own on the chat endpoint.
    ``tool_format``: the tool-call format every chat request is read and written in (a name of
    ``chat.formats.FORMATS``), instead of the one found in the model, as ``tool_format=`` does in process.
    ``metrics``: the model's series in its server's metric families.

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
    app = FastAPI(title="exllama-integrations", version="1")
    app.state.serve = state
    app.state.runtime = runtime
    add_error_answers(app)
    for router in model_routers():
        app.include_router(router)
    return app


def add_error_answers(app: FastAPI) -> None:
    """The app's answers to a bad body, a typed error, a client gone, an HTTP error and anything else."""

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
