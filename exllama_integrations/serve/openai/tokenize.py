"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` in vLLM's shapes.

A prompt or chat messages to the token ids the served model reads (images counted as the tokens the model reads
them as), ids back to text, and the tokenizer's configuration (so lm-evaluation-harness and others need no local
copy of the tokenizer).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ...chat.prepare import ChatRequest, prepare_chat
from ...contract.api import GenerationRequest, SharesTokenizer
from ...errors import BackendUnavailableError, InvalidSettingsError
from ..state import image_parts, state_of
from .convert import template_message
from .protocol.chat import MessageWire, ToolWire
from .protocol.common import Wire

router = APIRouter(tags=["tokens"])


class TokenizeRequest(Wire):
    """vLLM's ``/tokenize``: a ``prompt``, or ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[MessageWire] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the template writes its own)."""
    add_generation_prompt: bool = True
    tools: list[ToolWire] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """The ids, their count and the context length (and each id's text, when asked)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Wire):
    """vLLM's ``/detokenize``."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    """The text of the ids."""

    prompt: str


class TokenizerInfoResponse(BaseModel):
    """vLLM's ``/tokenizer_info``: the tokenizer's ``tokenizer_config.json`` and what this server renders with.

    File paths are left out and added tokens given as their text; ``tokenizer_class``, the eos and bos tokens where
    known, ``model_max_length`` (the served context) and the chat template the server renders with.
    """

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    model_max_length: int | None = None
    chat_template: str | None = None


def _ids(state: Any, body: TokenizeRequest) -> list[int]:
    runtime = state.runtime
    if (body.prompt is None) == (body.messages is None):
        raise InvalidSettingsError("/tokenize takes a prompt or messages (one of them).", param="prompt")
    if body.prompt is not None:
        request = GenerationRequest(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        assert body.messages is not None
        media: list[Any] = []
        images = image_parts([m.model_dump() for m in body.messages])
        if images:
            state.check_images(images)
        limits = state.limits.media.for_request()
        messages = [template_message(m, media, limits) for m in body.messages]
        if not body.add_generation_prompt:
            raise InvalidSettingsError(
                "/tokenize renders messages as a chat request is rendered, with the generation prompt; "
                "leave add_generation_prompt true.",
                param="add_generation_prompt",
            )
        chat = ChatRequest(
            messages=messages,
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            template_kwargs=dict(body.chat_template_kwargs or {}),
            chat_template=state.chat_template,
            media=media,
            tool_format=state.tool_format,
        )
        request = prepare_chat(runtime, chat).request
        if body.add_special_tokens:
            request = GenerationRequest(request.prompt, add_special_tokens=True, media=request.media)
    exact = getattr(runtime, "prompt_token_ids", None)
    if exact is not None:
        return list(exact(request))
    prompt = request.prompt
    return list(prompt) if isinstance(prompt, tuple) else runtime.encode(prompt, request.add_special_tokens)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of a prompt or of chat messages as the served model reads them (vLLM's shape).

    It counts in admission like a generation (a template or images may cost as much), and its work, the token
    strings included, runs off the event loop.
    """
    state = state_of(request.app)
    state.check_model(body.model)
    tok = getattr(state.runtime, "tokenizer", None)

    def work() -> tuple[list[int], list[str] | None]:
        ids = _ids(state, body)
        if not body.return_token_strs:
            return ids, None
        if tok is not None:
            return ids, [tok.decode([i], skip_special_tokens=False) for i in ids]
        return ids, [state.runtime.decode([i]) for i in ids]

    state.admit(request.state)
    ids, strs = await asyncio.to_thread(work)
    return TokenizeResponse(count=len(ids), max_model_len=state.info.context_length, tokens=ids, token_strs=strs)


def _plain(value: Any) -> Any:
    """A tokenizer_config value as JSON (an added token's ``{"content": ...}`` as its text)."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and ("__type" in value or "special" in value):
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def tokenizer_info(state: Any) -> TokenizerInfoResponse:
    """The served tokenizer's configuration in vLLM's shape (its eos and bos tokens always named when known).

    Raises:
        UnsupportedFeatureError: the runtime does not share its tokenizer's files.
    """
    runtime, info = state.runtime, state.info
    if not isinstance(runtime, SharesTokenizer):
        raise BackendUnavailableError(
            "this server's runtime does not share its tokenizer, so it has no /tokenizer_info."
        )
    files = runtime.tokenizer_files()
    config = {k: _plain(v) for k, v in dict(files.get("tokenizer_config") or {}).items()}
    for path_field in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        config.pop(path_field, None)
    tok = getattr(runtime, "tokenizer", None)
    for name, ids in (("eos_token", info.eos_token_ids[:1]), ("bos_token", (info.bos_token_id,))):
        if not isinstance(config.get(name), str) and tok is not None and ids and ids[0] is not None:
            config[name] = tok.decode([ids[0]], skip_special_tokens=False)
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config["model_max_length"] = info.context_length
    template = state.chat_template or files.get("chat_template")
    if template:
        config["chat_template"] = template
    return TokenizerInfoResponse(**config)


@router.get("/tokenizer_info", response_model=TokenizerInfoResponse)
async def get_tokenizer_info(request: Request) -> TokenizerInfoResponse:
    """The served tokenizer's configuration (vLLM's shape): what a client needs to tokenize as this server does."""
    state = state_of(request.app)
    return await asyncio.to_thread(tokenizer_info, state)  # reads the tokenizer's files


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids (vLLM's shape); an id outside the vocabulary is a 400."""
    state = state_of(request.app)
    state.check_model(body.model)
    vocab = state.info.vocab_size
    bad = [i for i in body.tokens if not 0 <= i < vocab]
    if bad:
        raise InvalidSettingsError(f"token ids must be in [0, {vocab}); got {bad[:5]}.", param="tokens")
    text = await asyncio.to_thread(state.runtime.decode, body.tokens)
    return DetokenizeResponse(prompt=text)


__all__ = ["router"]
