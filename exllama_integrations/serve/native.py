"""The native endpoints: the contract itself over HTTP, in its wire form (what RemoteRuntime speaks).

* ``GET /v1/exllama/info``: the served model's :class:`~exllama_integrations.contract.api.ModelInfo` and name;
* ``GET /v1/exllama/tokenizer``: its tokenizer files (clients count tokens and render prompts exactly);
* ``POST /v1/exllama/tokenize``: a request in the wire form -> ``{"token_ids": [...]}``, the ids its model reads
  (images counted as it reads them);
* ``POST /v1/exllama/embed`` and ``/v1/exllama/rerank``: an embedding or rerank request in the wire form, its result
  back (``/info`` carries the model's :class:`~exllama_integrations.contract.retrieval.EmbeddingInfo` as ``embedding``
  when it embeds or reranks);
* ``POST /v1/exllama/generate``: a :class:`~exllama_integrations.contract.api.GenerationRequest` in, its
  :class:`~exllama_integrations.contract.api.StreamChunk` values out as server-sent events (``data: {...}``),
  a typed error as ``data: {"error": {"code", "message", "fields"}}`` (or, before any output, as the
  response with the error's status), so a client raises the same class the server's runtime raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..contract import wire
from ..contract.api import GenerationRequest, SharesTokenizer, check_grammar_size
from ..contract.retrieval import Embeds, Reranks, embedder, reranker
from ..errors import BackendUnavailableError, ExLlamaIntegrationsError, InvalidSettingsError
from .state import ServeState, record, state_of
from .streaming import start_stream, until_disconnect

router = APIRouter(prefix="/v1/exllama", tags=["native"])


@router.get("/info")
async def info(request: Request) -> JSONResponse:
    """The served model's facts and the name clients use for it."""
    state = state_of(request.app)
    body = {"info": wire.to_data(state.info), "served_model_name": state.name, "version": __version__}
    runtime = state.runtime
    if isinstance(runtime, (Embeds, Reranks)):
        facts = runtime.embedding_info()
        if facts.task != "generate":
            body["embedding"] = wire.to_data(facts)
    return JSONResponse(body)


@router.post("/embed")
async def embed(request: Request) -> Response:
    """Embed a request given in the wire form; its result in the wire form (each input counts in admission)."""
    state = state_of(request.app)
    runtime = embedder(state.runtime_for(None))
    req = wire.loads_embedding_request(await request.body())
    with state.in_flight(len(req.inputs)):
        result = await until_disconnect(request, runtime.aembed(req))
    request.state.usage = (result.prompt_tokens, 0, 0.0)
    return Response(wire.dumps(result), media_type="application/json")


@router.post("/rerank")
async def rerank(request: Request) -> Response:
    """Rerank a request given in the wire form; its result in the wire form (each document counts in admission)."""
    state = state_of(request.app)
    runtime = reranker(state.runtime_for(None))
    req = wire.loads_rerank_request(await request.body())
    with state.in_flight(max(1, len(req.documents))):
        result = await until_disconnect(request, runtime.arerank(req))
    request.state.usage = (result.prompt_tokens, 0, 0.0)
    return Response(wire.dumps(result), media_type="application/json")


@router.get("/tokenizer")
async def tokenizer(request: Request) -> Any:
    """The tokenizer's files, for clients that count tokens and render prompts themselves."""
    runtime = state_of(request.app).runtime
    if not isinstance(runtime, SharesTokenizer):
        raise BackendUnavailableError(
            "this server's runtime does not share its tokenizer files, so clients cannot count tokens here."
        )
    return await asyncio.to_thread(runtime.tokenizer_files)


def _events(state: ServeState, request: GenerationRequest, scope_state: Any) -> AsyncIterator[bytes]:
    chunks = state.runtime.aopen(request)

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield b"data: " + wire.dumps(chunk) + b"\n\n"
                if chunk.usage is not None:
                    record(state, scope_state, chunk.usage, chunk.timings, chunk.finish_reason)
        except ExLlamaIntegrationsError as e:
            yield b"data: " + wire.dumps_error(e) + b"\n\n"
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    return events()


async def _admitted_request(request: Request) -> tuple[ServeState, GenerationRequest]:
    """The server's state and the request in the wire form, admitted first and its grammar's size checked."""
    state = state_of(request.app)
    state.admit(request.state)
    req = wire.loads_request(await request.body())
    check_grammar_size(req.grammar)
    return state, req


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    """The token ids the model reads for a request given in the wire form (images counted as the model reads them)."""
    state, req = await _admitted_request(request)
    count = getattr(state.runtime, "prompt_token_ids", None)
    if count is None:
        raise BackendUnavailableError("this server's runtime cannot count a request's tokens.")
    return JSONResponse({"token_ids": await asyncio.to_thread(count, req)})


@router.post("/generate")
async def generate(request: Request) -> Any:
    """Run a request given in the wire form; its chunks as server-sent events."""
    state, req = await _admitted_request(request)
    cap = state.limits.max_tokens
    if cap is not None and (req.settings.max_new_tokens is None or req.settings.max_new_tokens > cap):
        raise InvalidSettingsError(
            f"max_new_tokens is {req.settings.max_new_tokens}; this server allows at most {cap}.",
            param="max_new_tokens",
            reason="max_tokens_too_large",
        )
    return await start_stream(state, _events(state, req, request.state), "text/event-stream")
