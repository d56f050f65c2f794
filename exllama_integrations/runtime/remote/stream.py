"""Reading a server's native event stream: bounded lines in, stream chunks or the server's typed error out.

Everything a server sends is untrusted: a line may be at most ``MAX_EVENT_BYTES`` long, the whole call ends by
its deadline (keep-alive comments do not keep it open), and anything that is not the wire form is a
:class:`~exllama_integrations.errors.ProtocolError`. A closed stream closes its connection; the server
cancels the generation at its next step.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx

from ...contract import wire
from ...contract.api import GenerationResult, StreamChunk, result_of
from ...errors import ProtocolError, ServerError

MAX_EVENT_BYTES = wire.MAX_EVENT_BYTES


def _split(buffer: bytearray, data: bytes) -> list[bytes]:
    buffer.extend(data)
    if b"\n" not in data:
        if len(buffer) > MAX_EVENT_BYTES:
            raise ProtocolError(f"the server sent a line longer than {MAX_EVENT_BYTES} bytes; refusing it.")
        return []
    *lines, rest = bytes(buffer).split(b"\n")
    buffer[:] = rest
    if len(buffer) > MAX_EVENT_BYTES or any(len(line) > MAX_EVENT_BYTES for line in lines):
        raise ProtocolError(f"the server sent a line longer than {MAX_EVENT_BYTES} bytes; refusing it.")
    return lines


def lines(chunks: Iterable[bytes], deadline: float, url: str) -> Iterator[bytes]:
    """Lines of a byte stream, each bounded, the whole read by ``deadline`` (a monotonic time)."""
    buffer = bytearray()
    for data in chunks:
        yield from _split(buffer, data)
        if time.monotonic() > deadline:
            raise ServerError(
                f"{url} did not finish within the call's deadline; giving up (RemoteRuntime(timeout=...) sets it)."
            )
    if buffer:
        yield bytes(buffer)


async def alines(chunks: AsyncIterator[bytes], deadline: float, url: str) -> AsyncIterator[bytes]:
    """Async :func:`lines`."""
    buffer = bytearray()
    async for data in chunks:
        for line in _split(buffer, data):
            yield line
        if time.monotonic() > deadline:
            raise ServerError(
                f"{url} did not finish within the call's deadline; giving up (RemoteRuntime(timeout=...) sets it)."
            )
    if buffer:
        yield bytes(buffer)


def chunk_of_line(line: bytes) -> StreamChunk | None:
    """One event line as its chunk (None for comments and blank lines).

    Raises:
        ExLlamaIntegrationsError: the server reported an error (as the class it was raised as).
        ProtocolError: the line is not our wire form.
    """
    line = line.rstrip(b"\r")
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    try:
        event: Any = json.loads(data)
    except (ValueError, RecursionError):
        raise ProtocolError(f"the server sent an event that is not JSON: {data[:200]!r}") from None
    if isinstance(event, dict) and "error" in event:
        raise wire.loads_error(event)
    return wire.loads_chunk(event if isinstance(event, dict) else {"text": event})


class RemoteStream:
    """A generation on the server, read as stream chunks; ``close()`` closes the connection (the server cancels)."""

    def __init__(self, response: httpx.Response, backend: str, url: str, deadline: float) -> None:
        self._response, self._backend, self._url = response, backend, url
        self._lines = lines(response.iter_bytes(), deadline, url)
        self._chunks: list[StreamChunk] = []
        self.result: GenerationResult | None = None

    def __iter__(self) -> RemoteStream:
        return self

    def __next__(self) -> StreamChunk:
        if self.result is not None:
            raise StopIteration
        try:
            for line in self._lines:
                chunk = chunk_of_line(line)
                if chunk is None:
                    continue
                self._chunks.append(chunk)
                if chunk.finish_reason is not None:
                    self.result = result_of(self._chunks, self._backend)
                    self.close()
                return chunk
        except httpx.HTTPError as e:
            self.close()
            raise ServerError(f"the connection to {self._url} broke mid-stream: {e}") from None
        except BaseException:
            self.close()
            raise
        self.close()
        raise ProtocolError(f"{self._url} ended the stream before its last chunk.")

    def close(self) -> None:
        self._response.close()

    def __enter__(self) -> RemoteStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
