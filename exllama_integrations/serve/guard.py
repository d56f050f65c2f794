"""What every request passes before the endpoints, and how errors become OpenAI's error objects.

A pure ASGI middleware (streaming-safe, unlike Starlette's BaseHTTPMiddleware): the bearer key on
``/v1/`` (compared in constant time), the body cap (Content-Length, and counted while read), a request
id, and one log line per request with its tokens and timings.
"""

from __future__ import annotations

import difflib
import hmac
import logging
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse

from ..errors import (
    ConstraintError,
    ConstraintViolationError,
    ContextLengthError,
    InvalidModelError,
    InvalidSettingsError,
    RuntimeClosedError,
)
from .convert import WireError
from .schema import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("exllama_integrations.serve")


def error_body(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: BaseException) -> JSONResponse:
    """A typed error as OpenAI's error response with its status (bad input is never a 500)."""
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


class Guard:
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


def field_error(err: Any) -> str:
    """One schema error, an unknown field with its closest match."""
    where = ".".join(str(p) for p in err["loc"] if p != "body")
    if err.get("type") == "extra_forbidden":
        close = difflib.get_close_matches(str(err["loc"][-1]), _FIELDS, n=1)
        return f"{where}: unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
    return f"{where}: {err['msg']}"
