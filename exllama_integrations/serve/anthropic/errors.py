"""Errors in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, for the Messages API's paths.

The status comes from the one error table (:mod:`exllama_integrations.errors`), named as Anthropic names it: 400
``invalid_request_error``, 401 ``authentication_error``, 404 ``not_found_error``, 413 ``request_too_large``, 429
``rate_limit_error``, a full server (503 in the table) 529 ``overloaded_error`` with ``Retry-After``, other
failures 500 ``api_error``. :class:`AnthropicRoute` answers its routes' errors (bad bodies included) this way; the
guard uses :func:`error_body` for what it refuses before any route runs (a missing key, a body over the cap).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ...errors import ExLlamaIntegrationsError
from ..guard import did_you_mean
from ..streaming import ClientGone
from .protocol import ALL_FIELDS

logger = logging.getLogger("exllama_integrations.serve")

KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
"""Anthropic's error type for each status (any other 4xx: ``invalid_request_error``; 5xx: ``api_error``)."""


def wire_status(status: int) -> int:
    """The status Anthropic's clients expect: a server that cannot take the request now is 529 (overloaded)."""
    return 529 if status == 503 else status


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for a response of ``status`` (already :func:`wire_status`)."""
    kind = KINDS.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    """An error answer in Anthropic's shape (``Retry-After`` on 529 and 429)."""
    status = wire_status(status)
    headers = {"Retry-After": "1"} if status in (429, 529) else None
    return JSONResponse(error_body(status, message), status, headers=headers)


def typed_response(e: BaseException) -> JSONResponse:
    """A typed error with its table's status; anything else a logged 500 (bad input is never 500)."""
    if not isinstance(e, ExLlamaIntegrationsError):
        logger.exception("request failed", exc_info=e)
        return error_response(500, f"internal error: {type(e).__name__}")
    if type(e).status >= 500:
        logger.warning("request failed: %s: %s", type(e).__name__, e)
    message = str(e) if e.param is None or e.param in str(e) else f"{e.param}: {e}"
    return error_response(type(e).status, message)


def _field_error(err: Any) -> str:
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "extra_forbidden":
        return f"{where}: unknown field here" + did_you_mean(str(err["loc"][-1]), ALL_FIELDS)
    if err.get("type") == "json_invalid":
        return f"the body is not valid JSON: {err.get('msg')}"
    if err.get("type") == "missing":
        return f"{where}: Field required"
    return f"{where}: {err.get('msg')}"


def validation_response(e: RequestValidationError) -> JSONResponse:
    """A body that fails the schema: 400 ``invalid_request_error`` naming the fields (as Anthropic answers)."""
    errs = list(e.errors())
    # a discriminated union reports one error per member it tried; the first few name the field well enough
    return error_response(400, "; ".join(dict.fromkeys(_field_error(x) for x in errs[:5])) or "invalid request")


class AnthropicRoute(APIRoute):
    """A route whose errors, its body's validation included, are answered in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The route's handler, its errors turned into Anthropic's error objects."""
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return validation_response(e)
            except HTTPException as e:
                return error_response(e.status_code, str(e.detail))
            except ClientGone:
                raise  # nobody is there to read an answer: the app's handler ends the exchange
            except Exception as e:
                return typed_response(e)

        return answer


__all__ = ["AnthropicRoute", "error_body", "error_response", "typed_response", "validation_response", "wire_status"]
