"""The OpenAI-compatible HTTP API over any Runtime (FastAPI + uvicorn, SSE streaming).

``create_app(runtime)`` serves ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streamed
and not), ``/health``, and what :class:`~exllama_integrations.serve.remote.RemoteRuntime` needs
(``/v1/exllama/info``, ``/v1/exllama/tokenizer``). Every typed error becomes an OpenAI-shaped error
with its status (400 bad settings or context, 401 key, 404 model, 413 body, 422 schema, 503 queue
full); a client that disconnects cancels its generation at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..errors import (
    ConstraintError,
    ConstraintViolationError,
    ContextLengthError,
    ExLlamaIntegrationsError,
    InvalidModelError,
    InvalidSettingsError,
    MissingDependencyError,
    RuntimeClosedError,
)
from ..runtime.api import Runtime, StreamChunk
from ..runtime.chat import prepare_chat
from ..runtime.chat_outcome import ChatDelta, ChatOutcome, astream_chat, usage_dict
from . import convert
from .convert import WireError
from .schema import ChatCompletionRequest, CompletionRequest

try:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    raise MissingDependencyError("fastapi", "serve", "the HTTP server") from None

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


def error_body(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_response(e: BaseException) -> JSONResponse:
    if isinstance(e, WireError):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        body = error_body(str(e), kind, param=e.param, code=e.code)
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(body, status_code=e.status, headers=headers)
    if isinstance(e, ContextLengthError):
        return JSONResponse(error_body(str(e), "invalid_request_error", code="context_length_exceeded"), 400)
    if isinstance(e, (InvalidSettingsError, ConstraintError, ConstraintViolationError, InvalidModelError)):
        return JSONResponse(error_body(str(e), "invalid_request_error", code=type(e).__name__), 400)
    if isinstance(e, RuntimeClosedError):
        return JSONResponse(error_body(str(e), "server_error", code=type(e).__name__), 503)
    logger.exception("request failed", exc_info=e)
    return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error", code=type(e).__name__), 500)


class _Guard:
    """Pure ASGI middleware (streaming-safe): bearer key on /v1/, body size cap, one log line per request."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path.startswith("/v1/") and self.api_key is not None:
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                body = error_body(
                    "invalid or missing API key (Authorization: Bearer ...)",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await JSONResponse(body, 401)(scope, receive, send)
                return
        size = headers.get("content-length", "")
        too_big = error_body(
            f"the body is larger than the {self.max_body} bytes this server accepts",
            "invalid_request_error",
            code="request_too_large",
        )
        if size.isdigit() and int(size) > self.max_body:
            await JSONResponse(too_big, 413)(scope, receive, send)
            return
        seen = [0]
        status = [0]
        t0 = time.perf_counter()
        rid = headers.get("x-request-id") or uuid.uuid4().hex[:16]
        state = scope.setdefault("state", {})

        async def counted() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body:
                    raise _TooLarge
            return message

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if not status[0]:
                await JSONResponse(too_big, 413)(scope, receive, send)
        if scope.get("method") == "POST":
            tokens = state.get("usage")
            counts = f" prompt={tokens[0]} completion={tokens[1]} ttft={tokens[2]:.3f}s" if tokens else ""
            logger.info("id=%s POST %s %s%s total=%.3fs", rid, path, status[0], counts, time.perf_counter() - t0)


class _TooLarge(Exception):
    pass


_FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))


def _field_error(err: Any) -> str:
    where = ".".join(str(p) for p in err["loc"] if p != "body")
    if err.get("type") == "extra_forbidden":
        close = difflib.get_close_matches(str(err["loc"][-1]), _FIELDS, n=1)
        return f"{where}: unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
    return f"{where}: {err['msg']}"


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def create_app(
    runtime: Runtime,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    limits: ServeLimits | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The HTTP app serving ``runtime`` (which it does not close unless ``on_shutdown`` does)."""
    limits = limits or ServeLimits()
    info = runtime.model_info()
    name = served_model_name or info.name
    pending = [0]

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
        msg = "; ".join(_field_error(e) for e in errs[:5])
        return JSONResponse(error_body(msg, "invalid_request_error", param=where or None, code=first.get("type")), 422)

    @app.exception_handler(ExLlamaIntegrationsError)
    async def _typed(request: Request, exc: ExLlamaIntegrationsError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(WireError)
    async def _wire(request: Request, exc: WireError) -> JSONResponse:
        return _error_response(exc)

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)

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
        chunks = runtime.astream(prompt, settings, grammar=grammar, add_special_tokens=req.add_special_tokens)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await start(_completion_events(chunks, rid, name, req.return_details, include_usage, request.state))
        pending[0] += 1
        try:
            parts = [c async for c in chunks]
        finally:
            pending[0] -= 1
        final = parts[-1]
        assert final.finish_reason is not None and final.usage is not None
        _record(request.state, final.usage, final.timings)
        lps = [lp for c in parts for lp in (c.logprobs or ())] if settings.logprobs is not None else None
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(c.text for c in parts),
            "logprobs": convert.completion_logprobs(lps),
            "finish_reason": convert.finish_name(final.finish_reason),
        }
        if req.return_details:
            choice["exllama"] = convert.details(final)
        return convert.envelope("text_completion", rid, name, [choice], usage_dict(final.usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        check(req.model, req.max_completion_tokens or req.max_tokens)
        settings = resolve(req)
        prepared = await asyncio.to_thread(prepare_chat, runtime, convert.chat_request(req))
        items = astream_chat(runtime, prepared, settings, strict=False)
        rid = convert.new_id("chatcmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await start(_chat_events(items, rid, name, include_usage, request.state))
        pending[0] += 1
        try:
            outcome = [i async for i in items][-1]
        finally:
            pending[0] -= 1
        assert isinstance(outcome, ChatOutcome)
        _record(request.state, outcome.usage, outcome.timings)
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


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _record(state: Any, usage: Any, timings: Any) -> None:
    """What the request's log line reports."""
    state.usage = (usage.prompt_tokens, usage.completion_tokens, (timings and timings.time_to_first_token) or 0.0)


async def _completion_events(
    chunks: AsyncIterator[StreamChunk], rid: str, model: str, with_details: bool, include_usage: bool, state: Any
) -> AsyncIterator[bytes]:
    offset = 0
    try:
        async for c in chunks:
            choice: dict[str, Any] = {
                "index": 0,
                "text": c.text,
                "logprobs": convert.completion_logprobs(c.logprobs, offset),
                "finish_reason": convert.finish_name(c.finish_reason) if c.finish_reason else None,
            }
            offset += len(c.text)
            if with_details:
                choice["exllama"] = convert.details(c)
            yield _sse(convert.envelope("text_completion", rid, model, [choice]))
            if c.finish_reason is not None and c.usage is not None:
                _record(state, c.usage, c.timings)
            if c.finish_reason is not None and include_usage and c.usage is not None:
                yield _sse(convert.envelope("text_completion", rid, model, [], usage_dict(c.usage)))
    except ExLlamaIntegrationsError as e:  # after the first event the status is sent: report in the stream
        yield _sse(error_body(str(e), "server_error", code=type(e).__name__))
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()  # type: ignore[attr-defined]
    yield b"data: [DONE]\n\n"


async def _chat_events(
    items: AsyncIterator[ChatDelta | ChatOutcome], rid: str, model: str, include_usage: bool, state: Any
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _sse(convert.envelope("chat.completion.chunk", rid, model, [choice]))

    # the first step runs before anything is sent, so its errors (a prompt over the context, ...) get a status
    first = await items.__anext__()
    yield chunk({"role": "assistant", "content": ""})
    try:
        async for item in _prepend(first, items):
            if isinstance(item, ChatDelta):
                yield chunk({"content": item.text}, logprobs=convert.chat_logprobs(item.logprobs))
                continue
            _record(state, item.usage, item.timings)
            if item.tail:
                yield chunk({"content": item.tail})
            if item.tool_calls:
                yield chunk({"tool_calls": convert.tool_calls_wire(item.tool_calls, with_index=True)})
            yield chunk({}, item.finish_reason)
            if include_usage:
                yield _sse(convert.envelope("chat.completion.chunk", rid, model, [], usage_dict(item.usage)))
    except ExLlamaIntegrationsError as e:
        yield _sse(error_body(str(e), "server_error", code=type(e).__name__))
    finally:
        with anyio.CancelScope(shield=True):
            await items.aclose()  # type: ignore[attr-defined]
    yield b"data: [DONE]\n\n"
