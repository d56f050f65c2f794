"""The OpenAI-compatible HTTP API over any Runtime (FastAPI + uvicorn, SSE streaming).

``create_app(runtime)`` serves ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streamed
and not), ``/health``, and what :class:`~exllama_integrations.serve.remote.RemoteRuntime` needs
(``/v1/exllama/info``, ``/v1/exllama/tokenizer``). Every typed error becomes an OpenAI-shaped error
with its status (400 bad settings or context, 401 key, 404 model, 413 body, 422 schema, 503 queue
full); a client that disconnects cancels its generation at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import (
    ExLlamaIntegrationsError,
    MissingDependencyError,
)

try:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    raise MissingDependencyError("fastapi", "serve", "the HTTP server") from None

from ..runtime.api import Runtime, result_of
from ..runtime.chat import aprepare_chat
from ..runtime.chat_outcome import ChatOutcome, astream_chat, usage_dict
from . import convert
from .convert import WireError
from .events import chat_events, completion_events, record
from .guard import Guard, error_body, error_response, field_error
from .schema import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("exllama_integrations.serve")


@dataclass(frozen=True)
class ServeLimits:
    """What one server accepts."""

    max_body_bytes: int = 8 * 2**20
    """Largest request body; larger ones get 413."""
    max_tokens: int | None = None
    """Largest ``max_tokens`` a request may ask for (None: the context decides)."""
    max_pending: int = 256
    """Requests in flight at once (decoding or waiting); more get 503 with ``Retry-After``."""


def create_app(
    runtime: Runtime,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    limits: ServeLimits | None = None,
    on_shutdown: Callable[[], None] | None = None,
    freeze_gc: bool = False,
) -> FastAPI:
    """The HTTP app serving ``runtime`` (which it does not close unless ``on_shutdown`` does).

    ``freeze_gc``: when the app starts, every object alive then (the loaded model, torch, the libraries) is
    moved out of the garbage collector's scans (``gc.freeze()``), as a server that owns its process should.
    A full collection of a process with torch and ExLlama loaded scans half a million objects or more and
    holds the GIL for a quarter of a second or more, pausing every generation in flight (seen on the H200
    under load: 239 and 309 ms). ``exllama-integrations serve`` and the Ray replicas turn it on.
    """
    limits = limits or ServeLimits()
    info = runtime.model_info()
    name = served_model_name or info.name
    pending = [0]

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if freeze_gc:
            gc.collect()
            gc.freeze()
            logger.info("%d objects alive at startup are left out of garbage collection", gc.get_freeze_count())
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="exllama-integrations", version="1", lifespan=lifespan)  # type: ignore[arg-type]
    app.state.runtime = runtime

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return JSONResponse(
                error_body(
                    f"the body is not valid JSON: {first.get('msg')}", "invalid_request_error", code="invalid_json"
                ),
                400,
            )
        msg = "; ".join(field_error(e) for e in errs[:5])
        return JSONResponse(error_body(msg, "invalid_request_error", param=where or None, code=first.get("type")), 422)

    @app.exception_handler(ExLlamaIntegrationsError)
    async def _typed(request: Request, exc: ExLlamaIntegrationsError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(WireError)
    async def _wire(request: Request, exc: WireError) -> JSONResponse:
        return error_response(exc)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)

    def check(model: str, max_tokens: int | None) -> None:
        if model not in (name, info.name):
            raise WireError(
                404,
                f"model {model!r} is not served here; this server serves {name!r}.",
                param="model",
                code="model_not_found",
            )
        if limits.max_tokens is not None and (max_tokens or 0) > limits.max_tokens:
            raise WireError(
                400,
                f"max_tokens is {max_tokens}; this server allows at most {limits.max_tokens}.",
                param="max_tokens",
                code="max_tokens_too_large",
            )
        if pending[0] >= limits.max_pending:
            raise WireError(
                503,
                f"the server has {pending[0]} requests in flight (its limit); retry shortly.",
                code="server_overloaded",
            )

    def resolve(req: CompletionRequest | ChatCompletionRequest) -> Any:
        overrides = convert.settings_overrides(req)
        base = None
        if convert.fills_context(req):
            if limits.max_tokens is not None:
                raise WireError(
                    400,
                    f"max_tokens must be set (at most {limits.max_tokens}) on this server.",
                    param="max_tokens",
                    code="max_tokens_too_large",
                )
            base = runtime.resolve_settings().model_copy(update={"max_new_tokens": None})
        return runtime.resolve_settings(base, **overrides)

    @contextlib.contextmanager
    def in_flight() -> Iterator[None]:
        pending[0] += 1
        try:
            yield
        finally:
            pending[0] -= 1

    async def start(items: AsyncIterator[bytes]) -> StreamingResponse:
        """Run to the first event before answering, so errors before any output get their status.

        The request counts as in flight until its stream ends; a client that disconnects ends it, and
        closing the events (shielded from the cancellation) cancels the generation at its next step.
        """
        pending[0] += 1
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            first = b""
        except BaseException:
            pending[0] -= 1
            with anyio.CancelScope(shield=True):
                await items.aclose()  # type: ignore[attr-defined]
            raise

        async def events() -> AsyncIterator[bytes]:
            try:
                yield first
                async for b in items:
                    yield b
            finally:
                pending[0] -= 1
                with anyio.CancelScope(shield=True):
                    await items.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(events(), media_type="text/event-stream")

    # ----------------------------------------------------------------- endpoints

    @app.get("/health")
    async def health() -> dict[str, Any]:
        status = "ok" if not runtime.closed else "closed"
        return {"status": status, "model": name, "in_flight": pending[0], "pid": os.getpid()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(name, info)]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict[str, Any]:
        check(model_id, None)
        return _model_card(name, info)

    @app.get("/v1/exllama/info")
    async def model_info() -> dict[str, Any]:
        d = dataclasses.asdict(runtime.model_info())
        return {**d, "served_model_name": name}

    @app.get("/v1/exllama/tokenizer")
    async def tokenizer_files() -> dict[str, Any]:
        files = getattr(runtime, "tokenizer_files", None)
        if files is None:
            raise WireError(404, "this runtime does not share its tokenizer files", code="not_available")
        return await asyncio.to_thread(files)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        check(req.model, req.max_tokens)
        settings = resolve(req)
        prompt, grammar = convert.completion_prompt(req), convert.completion_grammar(req)
        rid = convert.new_id("cmpl")
        chunks = runtime.astream(
            prompt,
            settings,
            grammar=grammar,
            add_special_tokens=req.add_special_tokens,
            incremental=bool(req.stream) and req.incremental,
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await start(completion_events(chunks, rid, name, req.return_details, include_usage, request.state))
        with in_flight():
            parts = [c async for c in chunks]
        result = result_of(parts, info.backend)
        record(request.state, result.usage, result.timings)
        choice: dict[str, Any] = {
            "index": 0,
            "text": result.text,
            "logprobs": convert.completion_logprobs((result.logprobs or ()) if settings.logprobs is not None else None),
            "finish_reason": convert.finish_name(result.finish_reason),
        }
        if req.return_details:
            choice["exllama"] = convert.details(parts[-1])
        return convert.envelope("text_completion", rid, name, [choice], usage_dict(result.usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        check(req.model, req.max_completion_tokens or req.max_tokens)
        settings = resolve(req)
        prepared = await aprepare_chat(runtime, convert.chat_request(req))
        items = astream_chat(runtime, prepared, settings, strict=False, incremental=bool(req.stream))
        rid = convert.new_id("chatcmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await start(chat_events(items, rid, name, include_usage, request.state))
        with in_flight():
            outcome = [i async for i in items][-1]
        assert isinstance(outcome, ChatOutcome)
        record(request.state, outcome.usage, outcome.timings)
        choice = {
            "index": 0,
            "message": convert.chat_message(outcome),
            "logprobs": convert.chat_logprobs(outcome.logprobs),
            "finish_reason": outcome.finish_reason,
        }
        return convert.envelope("chat.completion", rid, name, [choice], usage_dict(outcome.usage))

    return app


def _model_card(name: str, info: Any) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "exllama-integrations",
        "context_length": info.context_length,
        "backend": info.backend,
    }
