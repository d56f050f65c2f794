"""How an endpoint answers: a stream or a whole body, ended (its generation cancelled) when the client goes away.

A stream runs to its first event before the response starts, so an error before any output (a prompt over the
context, bad settings) gets its own status; after that, an error becomes an event in the stream. A whole (non-
streamed) answer is computed while the connection is watched: a client that disconnects cancels it. Admission is
the endpoint's, before it prepares anything (:meth:`~.state.ServeState.admit`), and ends when the guard has sent
the response.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import ExLlamaIntegrationsError
from .state import ServeState

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its generation was cancelled)."""


async def start_stream(state: ServeState, events: AsyncIterator[bytes], media_type: str) -> StreamingResponse:
    """The response for ``events``: run to its first event, then streamed (``state`` admitted it already)."""

    async def close() -> None:
        await events.aclose()  # type: ignore[attr-defined]

    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = b""
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close()
        raise

    async def rest() -> AsyncIterator[bytes]:
        try:
            yield first
            async for b in events:
                yield b
        finally:
            with anyio.CancelScope(shield=True):
                await close()

    return StreamingResponse(rest(), media_type=media_type)


async def framed_events(
    source: AsyncIterator[T],
    render: Callable[[T], Iterable[bytes]],
    on_error: Callable[[ExLlamaIntegrationsError], bytes],
    opening: Callable[[T], Iterable[bytes]] | None = None,
    last: bytes = b"",
) -> AsyncIterator[bytes]:
    """``source``'s items rendered as an API's events, then ``last`` (if any), for every API that streams.

    The first item is awaited before anything is yielded, outside the error handling: an error there reaches the
    endpoint, which answers with its status. The first item's events are ``opening(first)`` (an API's preamble, then
    the item's own), or ``render(first)``. After that, a typed error becomes ``on_error``'s event. The source is closed
    at the end, shielded from a disconnect's cancellation, so its generation stops. An empty source yields ``last``.
    """
    try:
        first = await source.__anext__()
    except StopAsyncIteration:
        if last:
            yield last
        return
    try:
        for b in (opening or render)(first):
            yield b
        async for item in source:
            for b in render(item):
                yield b
    except ExLlamaIntegrationsError as e:
        yield on_error(e)
    finally:
        with anyio.CancelScope(shield=True):
            await source.aclose()  # type: ignore[attr-defined]
    if last:
        yield last


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, cancelled (and :class:`ClientGone` raised) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while True:
            message: Any = await request.receive()
            if message.get("type") == "http.disconnect":
                return

    watcher = asyncio.ensure_future(listen())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


async def whole(state: ServeState, request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """A non-streamed answer: ``work()`` computed while the client is watched (``state`` admitted it already)."""
    return await until_disconnect(request, work())
