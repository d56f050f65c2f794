"""OpenAI wire requests to runtime calls, and runtime results back to OpenAI wire responses (plain dicts)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..runtime.api import Grammar, StreamChunk, TokenLogprob
from ..runtime.chat import ChatRequest
from ..runtime.chat_outcome import ChatOutcome, ParsedToolCall, logprobs_content, usage_dict
from .schema import ChatCompletionRequest, CompletionRequest, MessageWire

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


class WireError(Exception):
    """A request the server refuses: an OpenAI-shaped error with this status, type, param and code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


WIRE_SETTINGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "typical_p": "typical",
    "no_repeat_ngram_size": "no_repeat_ngram_size",
    "ignore_eos": "ignore_eos",
    "truncate_prompt": "truncate_prompt",
}
"""Request fields that are one generation setting each, as is (wire name: setting name); ``max_tokens``,
``logprobs``, ``stop`` and ``stop_token_ids`` take a conversion and are mapped where they are used."""


def _refuse(field: str, why: str) -> WireError:
    return WireError(400, f"{field}: {why}", param=field, code="unsupported_parameter")


def fills_context(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request sent ``max_tokens: null`` explicitly (our extension: generate up to the context)."""
    names = ("max_tokens", "max_completion_tokens")
    sent = [n for n in names if n in req.model_fields_set]
    return bool(sent) and all(getattr(req, n) is None for n in sent)


def settings_overrides(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The request's sampling fields as runtime settings overrides (OpenAI's fields we cannot honour refused)."""
    if req.n != 1:
        raise _refuse("n", f"only n=1 is served (got {req.n}); send {req.n} requests, they are batched together.")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise _refuse(name, "not supported; use repetition_penalty (our extension) instead.")
    if req.logit_bias:
        raise _refuse("logit_bias", "not supported; use a grammar (response_format or tools) to constrain output.")
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        if req.echo or req.suffix is not None or (req.best_of or 1) > 1:
            bad = "echo" if req.echo else "suffix" if req.suffix is not None else "best_of"
            raise _refuse(bad, "not supported by this server.")
        logprobs = req.logprobs
    values = {setting: getattr(req, field) for field, setting in WIRE_SETTINGS.items()}
    values.update(
        max_new_tokens=max_tokens,
        stop_token_ids=req.stop_token_ids,
        logprobs=logprobs,
        stop=[req.stop] if isinstance(req.stop, str) else req.stop,
    )
    return {k: v for k, v in values.items() if v is not None}


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (a list of several is refused: send them as requests)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise _refuse("prompt", "one prompt per request; send several requests (they are batched together).")
        return p[0]  # type: ignore[return-value]
    return p  # type: ignore[return-value]


def completion_grammar(req: CompletionRequest) -> Grammar | None:
    """The request's grammar extension as a Grammar value."""
    if req.grammar is None:
        return None
    return Grammar.from_dict(req.grammar.model_dump())


def _message_text(m: MessageWire) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.type != "text":
            raise WireError(
                400,
                f"message content of type {part.type!r} is not supported: this model takes text only.",
                param="messages",
                code="unsupported_content",
            )
        parts.append(part.text or "")
    return "".join(parts)


def chat_request(req: ChatCompletionRequest) -> ChatRequest:
    """The wire chat call as the plain-data chat request every front door uses."""
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        role = "system" if m.role == "developer" else "tool" if m.role == "function" else m.role
        d: dict[str, Any] = {"role": role, "content": _message_text(m)}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        messages.append(d)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=req.tool_choice if tools else None,
        response_format=req.response_format,
        template_kwargs=req.chat_template_kwargs or {},
        split_special_tokens=req.split_special_tokens,
    )


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_logprobs(lps: Sequence[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """Logprobs in the completions API's shape (tokens, token_logprobs, top_logprobs, text_offset)."""
    if lps is None:
        return None
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def details(chunk: StreamChunk) -> dict[str, Any]:
    """Our ``exllama`` extension of a completion choice: what RemoteRuntime needs to rebuild the chunk exactly."""
    d: dict[str, Any] = {"token_ids": list(chunk.token_ids)}
    if chunk.logprobs is not None:
        d["logprobs"] = [
            {
                "token_id": lp.token_id,
                "token": lp.token,
                "logprob": lp.logprob,
                "top": [[t.token_id, t.token, t.logprob] for t in lp.top],
            }
            for lp in chunk.logprobs
        ]
    if chunk.finish_reason is not None:
        assert chunk.usage is not None and chunk.timings is not None
        d.update(
            finish_reason=chunk.finish_reason,
            stop_string=chunk.stop_string,
            constraint_complete=chunk.constraint_complete,
            usage=usage_dict(chunk.usage),
            timings={
                "time_to_first_token": chunk.timings.time_to_first_token,
                "total": chunk.timings.total,
                "tokens_per_second": chunk.timings.tokens_per_second,
            },
        )
    return d


def envelope(kind: str, rid: str, model: str, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
    """An OpenAI response or chunk object around ``choices``."""
    out: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def finish_name(native: str) -> str:
    """OpenAI's name for a native finish reason (a reader's cancellation never reaches a client)."""
    return _FINISH.get(native, native)


def tool_calls_wire(calls: Sequence[ParsedToolCall], with_index: bool = False) -> list[dict[str, Any]]:
    """Parsed calls as OpenAI tool calls; a malformed call keeps its raw text as the arguments."""
    out = []
    for i, c in enumerate(calls):
        args = c.raw if c.error else json.dumps(c.arguments, ensure_ascii=False)
        d: dict[str, Any] = {"id": c.id, "type": "function", "function": {"name": c.name or "", "arguments": args}}
        if with_index:
            d["index"] = i
        out.append(d)
    return out


def chat_message(outcome: ChatOutcome) -> dict[str, Any]:
    """The assistant message of a finished chat."""
    msg: dict[str, Any] = {"role": "assistant", "content": outcome.content}
    if outcome.tool_calls:
        msg["tool_calls"] = tool_calls_wire(outcome.tool_calls)
        msg["content"] = outcome.content or None
    return msg


def chat_logprobs(lps: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
    """Logprobs in the chat API's shape."""
    return None if lps is None else {"content": logprobs_content(lps)}
