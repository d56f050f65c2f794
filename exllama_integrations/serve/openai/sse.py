"""Server-sent events in OpenAI's framing: one ``data: {...}`` line per chunk object, ``data: [DONE]`` last.

After the first event the status is sent, so a typed error becomes an error event in the stream; the source
is closed at the end, shielded from a disconnect's cancellation, so its generation stops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel

from ...errors import ExLlamaIntegrationsError
from ..guard import error_body

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def sse(obj: BaseModel | dict[str, Any]) -> bytes:
    """One SSE event."""
    if isinstance(obj, BaseModel):
        return b"data: " + obj.model_dump_json(exclude_none=False).encode() + b"\n\n"
    import json

    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def framed(
    source: AsyncIterator[T], render: Callable[[T], Iterable[bytes]], preamble: Iterable[bytes] = ()
) -> AsyncIterator[bytes]:
    """``source``'s items rendered as events, then ``data: [DONE]``.

    The first item is awaited before anything is yielded, outside the error handling: an error there
    reaches the endpoint, which answers with its status.
    """
    try:
        first = await source.__anext__()
    except StopAsyncIteration:
        yield DONE
        return
    try:
        for b in preamble:
            yield b
        for b in render(first):
            yield b
        async for item in source:
            for b in render(item):
                yield b
    except ExLlamaIntegrationsError as e:
        kind = "invalid_request_error" if type(e).status < 500 else "server_error"
        yield sse(error_body(str(e), kind, param=e.param, code=getattr(e, "reason", None) or type(e).code))
    finally:
        with anyio.CancelScope(shield=True):
            await source.aclose()  # type: ignore[attr-defined]
    yield DONE
