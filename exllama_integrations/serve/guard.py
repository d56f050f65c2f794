"""What every request passes before the endpoints, and how errors become OpenAI's error objects.

A pure ASGI middleware (streaming-safe, unlike Starlette's BaseHTTPMiddleware): the key on every path but
``/health`` (the API docs included), as ``Authorization: Bearer`` or else Anthropic's ``x-api-key``, compared in
constant time; the body cap (Content-Length, and counted while read, chunked bodies too: over it is a 413 before
any endpoint runs); a deadline on reading the body (a client that trickles it gets a 408 and its connection back);
the one wire rule for text (a JSON body in UTF-16 or UTF-32, which JSON readers take, is read as UTF-8 first;
then a body whose strings hold a lone surrogate, escaped or not, U+D800 to U+DFFF without its pair, is a 400 here,
so no text field of any endpoint carries one inward, where it could not be encoded); a request id; the end of a
request's admission once its response has been sent (:meth:`~.state.ServeState.admit`); and one log line per
request with its tokens and timings (the path quoted, so it cannot forge a line). What it refuses is answered in
OpenAI's error shape, or in the shape of the API a path belongs to (``shapes``).
"""

from __future__ import annotations

import asyncio
import difflib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from fastapi.responses import JSONResponse

from ..errors import ExLlamaIntegrationsError, InvalidSettingsError

logger = logging.getLogger("exllama_integrations.serve")

OPEN_PATHS = frozenset({"/health"})
"""Paths that answer without the key (a load balancer's health check)."""

_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"  # a high one without its low one
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"  # a low one without its high one
)


def lone_surrogate(body: bytes) -> int | None:
    r"""Where a JSON body's text holds a lone surrogate escape, or None.

    A lone one is a high surrogate escape not followed by a low one, or a low one alone: valid JSON, but no
    Unicode text, and it cannot be encoded anywhere after. UTF-8 bytes cannot hold a surrogate (an invalid body
    fails as JSON), so only ``\u`` escapes are read, once escaped backslashes are blanked (``\\u`` is text).
    """
    if not _SURROGATE.search(body):
        return None
    text = body.replace(b"\\\\", b"  ")  # escaped backslashes, paired from the left as JSON reads them
    if not _SURROGATE.search(_PAIR.sub(b"", text)):  # the common case (emoji) at C speed
        return None
    found = _LONE_SURROGATE.search(text)
    return None if found is None else found.start()


def as_utf8(body: bytes) -> bytes:
    """A JSON body as UTF-8: one in UTF-16 or UTF-32 (which JSON readers detect and take) decoded and encoded again.

    Raises:
        UnicodeDecodeError: the body is not valid text in its encoding (a lone surrogate code unit in UTF-16).
    """
    encoding = json.detect_encoding(body)
    if encoding in ("utf-8", "utf-8-sig"):
        return body
    return body.decode(encoding).encode("utf-8")  # strict: a lone surrogate does not decode


ErrorShape = Callable[[int, str], dict[str, Any]]
"""An API's own error object for ``(status, message)``, for the paths under its prefix (``Guard``'s ``shapes``)."""


def error_body(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: BaseException) -> JSONResponse:
    """A typed error as OpenAI's error response, with the status of the one error table (bad input is never 500)."""
    if not isinstance(e, ExLlamaIntegrationsError):
        logger.exception("request failed", exc_info=e)
        return JSONResponse(
            error_body(f"internal error: {type(e).__name__}", "server_error", code="internal_error"), 500
        )
    status = type(e).status
    if status >= 500 and not isinstance(e, InvalidSettingsError):
        logger.warning("request failed: %s: %s", type(e).__name__, e)
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = getattr(e, "reason", None) or type(e).code
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(error_body(str(e), kind, param=e.param, code=code), status_code=status, headers=headers)


def did_you_mean(name: str, fields: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``fields`` to a refused ``name``, or nothing.

    Never ``name`` itself: a field of another endpoint (or another level of the body) is refused here, and
    suggesting it again would say nothing.
    """
    close = difflib.get_close_matches(name, [f for f in fields if f != name], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def field_error(err: dict[str, Any], fields: list[str]) -> str:
    """One schema error in a line; an unknown field with its closest match among ``fields``."""
    where = ".".join(str(p) for p in err["loc"] if p != "body")
    if err.get("type") == "extra_forbidden":
        return f"{where}: unknown field here" + did_you_mean(str(err["loc"][-1]), fields)
    return f"{where}: {err['msg']}"


def validation_response(errors: list[Any], fields: list[str]) -> JSONResponse:
    """A body that fails the schema, as OpenAI answers it: 400 ``invalid_request_error``, the first bad field named.

    Not FastAPI's 422: the openai client raises that as ``UnprocessableEntityError``, which agent frameworks do not
    read as a bad request.
    """
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        msg = f"the body is not valid JSON: {first.get('msg')}"
        return JSONResponse(error_body(msg, "invalid_request_error", code="invalid_json"), 400)
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    msg = "; ".join(field_error(e, fields) for e in errors[:5])
    return JSONResponse(error_body(msg, "invalid_request_error", param=where or None, code=first.get("type")), 400)


class Guard:
    """Pure ASGI middleware (see the module docstring)."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout: float = 30.0,
        shapes: Mapping[str, ErrorShape] | None = None,
    ) -> None:
        """``shapes``: path prefix -> that API's error shape (other paths: OpenAI's)."""
        self.app, self.api_key, self.max_body, self.body_timeout = app, api_key, max_body_bytes, body_timeout
        self.shapes = dict(shapes or {})

    def _refusal(
        self, path: str, status: int, message: str, code: str, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        for prefix, shape in self.shapes.items():
            if path == prefix or path.startswith(prefix + "/"):
                return JSONResponse(shape(status, message), status, headers=headers)
        return JSONResponse(error_body(message, "invalid_request_error", code=code), status, headers=headers)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and path not in OPEN_PATHS:
            given = headers.get("authorization", "")
            # one key, one comparison: the bearer token when one is sent, else Anthropic's header
            token = given[7:] if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                why = "invalid or missing API key (Authorization: Bearer ..., or x-api-key: ...)"
                await self._refusal(path, 401, why, "invalid_api_key")(scope, receive, send)
                return
        too_big = f"the body is larger than the {self.max_body} bytes this server accepts"
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > self.max_body:
            await self._refusal(path, 413, too_big, "request_too_large")(scope, receive, send)
            return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            try:
                payload, complete = await asyncio.wait_for(_read_body(receive, self.max_body), self.body_timeout)
            except asyncio.TimeoutError:
                slow = (
                    f"the body did not arrive within {self.body_timeout:g} s; send it whole, then wait for the answer"
                )
                closing = {"Connection": "close"}
                await self._refusal(path, 408, slow, "request_timeout", closing)(scope, receive, send)
                return
            if payload is None:
                await self._refusal(path, 413, too_big, "request_too_large")(scope, receive, send)
                return
            if complete:
                try:
                    payload = as_utf8(payload)
                except UnicodeDecodeError as e:
                    bad = (
                        f"the body is {e.encoding.upper()} that does not decode ({e.reason} at byte {e.start}); send "
                        "valid Unicode text, best as UTF-8"
                    )
                    await self._refusal(path, 400, bad, "invalid_text")(scope, receive, send)
                    return
            where = lone_surrogate(payload) if complete else None
            if where is not None:
                bad = (
                    f"the body's text holds a lone surrogate escape ({payload[where : where + 6].decode()!r} at byte "
                    f"{where}), which is no character; send valid Unicode (a pair of escapes for one character "
                    "beyond U+FFFF)"
                )
                await self._refusal(path, 400, bad, "invalid_text")(scope, receive, send)
                return
            if complete:
                receive = _replay(payload, receive)
        status = [0]
        t0 = time.perf_counter()
        rid = headers.get("x-request-id", "")[:64] or uuid.uuid4().hex[:16]
        state = scope.setdefault("state", {})

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            release = state.pop("release", None)  # what the request's admission counted, once its response is sent
            if release is not None:
                release()
        if scope.get("method") == "POST":
            tokens = state.get("usage")
            counts = f" prompt={tokens[0]} completion={tokens[1]} ttft={tokens[2]:.3f}s" if tokens else ""
            if "model" in state:  # a server of several models says which answered
                counts = f" model={state['model']!r}{counts}"
            logger.info(
                "id=%r POST %r %s%s total=%.3fs",
                rid,
                scope.get("raw_path", b"").decode("latin-1") or path,
                status[0],
                counts,
                time.perf_counter() - t0,
            )


async def _read_body(receive: Any, limit: int) -> tuple[bytes | None, bool]:
    """The whole body, or None once it is over ``limit`` bytes (chunked bodies included)."""
    parts: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), False  # the client went away: let the app see it
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None, False
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), True


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the app the body once, then what the client sends (its disconnect)."""
    sent = [False]

    async def replayed() -> dict[str, Any]:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # type: ignore[no-any-return]

    return replayed


def header_deadline_protocol(seconds: float) -> type:
    """The HTTP/1.1 protocol of uvicorn with a deadline on the request line and headers.

    uvicorn bounds the idle time between requests (``--timeout-keep-alive``) but not the time a client takes
    to send its headers, so a client that connects and trickles them (or sends nothing) holds a connection
    for ever. Here a connection that has no complete request head ``seconds`` after it opened, or after its
    next request's first byte, is closed; the body has its own deadline in :class:`Guard`.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _too_slow(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                logger.info("closed a connection whose request head took over %g s", seconds)
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_head():
                self._arm()
            super().data_received(data)
            if not self._waiting_for_head():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadline
