"""Reading a server's answers back: SSE events to stream chunks exactly as the runtime made them, errors to types."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from ..errors import (
    ConstraintError,
    ConstraintViolationError,
    ContextLengthError,
    ExLlamaIntegrationsError,
    InvalidModelError,
    InvalidSettingsError,
    ModelNotFoundError,
    RuntimeClosedError,
    ServerBusyError,
    ServerError,
)
from ..runtime.api import GenerationResult, StreamChunk, Timings, TokenLogprob, TopLogprob, Usage, result_of

_TYPED: dict[str, type[ExLlamaIntegrationsError]] = {
    c.__name__: c
    for c in (InvalidSettingsError, ConstraintError, ConstraintViolationError, InvalidModelError, RuntimeClosedError)
}
_CONTEXT = re.compile(r"prompt is (\d+) tokens and max_new_tokens is (\d+), but the context is (\d+)")


def error_of(status: int, body: Any, url: str) -> ExLlamaIntegrationsError:
    """The typed error a server's error response stands for."""
    err = body.get("error", {}) if isinstance(body, dict) else {}
    message, code = str(err.get("message") or body), err.get("code")
    if code == "context_length_exceeded" and (m := _CONTEXT.search(message)):
        return ContextLengthError(*(int(g) for g in m.groups()))
    if code in _TYPED:
        return _TYPED[code](message)
    if status == 404:
        return ModelNotFoundError(message)
    if status in (400, 413, 422):
        return InvalidSettingsError(message)
    if status == 503:
        return ServerBusyError(message, status)
    if status == 401:
        return ServerError(f"{url} refused the API key: {message} (pass api_key= or set EXLLAMA_API_KEY)", status)
    return ServerError(f"{url} answered {status}: {message}", status)


def chunk_of(choice: dict[str, Any]) -> StreamChunk:
    """A completion choice with our `exllama` details as the stream chunk the server's runtime made."""
    d = choice.get("exllama") or {}
    lps = None
    if d.get("logprobs") is not None:
        lps = tuple(
            TokenLogprob(x["token_id"], x["token"], x["logprob"], tuple(TopLogprob(*t) for t in x["top"]))
            for x in d["logprobs"]
        )
    usage = timings = None
    if d.get("finish_reason") is not None:
        u, t = d["usage"], d["timings"]
        usage = Usage(u["prompt_tokens"], u["completion_tokens"])
        timings = Timings(t["time_to_first_token"], t["total"], t["tokens_per_second"])
    return StreamChunk(
        choice.get("text") or "",
        tuple(d.get("token_ids") or ()),
        lps,
        d.get("finish_reason"),
        usage,
        timings,
        d.get("stop_string"),
        d.get("constraint_complete"),
    )


def chunk_of_line(line: str, url: str) -> StreamChunk | None:
    """One SSE line of a completion stream as its chunk (None for comments, blank lines, [DONE], usage).

    Raises:
        ExLlamaIntegrationsError: the server reported an error in the stream (typed as it was raised).
    """
    if not line.startswith("data: "):
        return None
    data = line[6:].strip()
    if data == "[DONE]":
        return None
    event: dict[str, Any] = json.loads(data)
    if "error" in event:
        raise error_of(500, event, url)
    return chunk_of(event["choices"][0]) if event.get("choices") else None


class RemoteStream:
    """A generation on the server, read as stream chunks; ``close()`` closes the connection (the server cancels)."""

    def __init__(self, response: httpx.Response, backend: str, url: str) -> None:
        self._response, self._backend, self._url = response, backend, url
        self._lines = response.iter_lines()
        self._chunks: list[StreamChunk] = []
        self.result: GenerationResult | None = None

    def __iter__(self) -> RemoteStream:
        return self

    def __next__(self) -> StreamChunk:
        if self.result is not None:
            raise StopIteration
        try:
            for line in self._lines:
                chunk = chunk_of_line(line, self._url)
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
        self.close()
        raise ServerError(f"{self._url} ended the stream before its last chunk.")

    def close(self) -> None:
        self._response.close()

    def __enter__(self) -> RemoteStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
