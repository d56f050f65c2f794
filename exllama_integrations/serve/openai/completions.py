"""``POST /v1/completions``: prompts completed (or scored), streamed or whole, in OpenAI's text-completion shape."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import APIRouter, Request

from ...contract.api import GenerationResult, StreamChunk, TokenLogprob, Usage
from ...contract.shapes import completion_logprobs, finish_name, usage_dict
from ...runtime.base import acollect
from ..rules import ERRORS, check_finish, new_id
from ..state import ServeState, record, state_of
from ..streaming import start_stream, whole
from .choices import announce, merged, summed_usage
from .protocol.common import UsageWire
from .protocol.completions import CompletionChoice, CompletionRequest, CompletionResponse
from .stream import framed, sse

router = APIRouter(tags=["openai"])


def echo_logprobs(prompt: Sequence[TokenLogprob], lps: Sequence[TokenLogprob]) -> dict[str, Any] | None:
    """The completions API's logprobs of an echoed prompt and its completion: the first token's are ``null``."""
    shaped = completion_logprobs([*prompt, *lps])
    if shaped is not None and prompt:
        shaped["token_logprobs"][0] = None
        shaped["top_logprobs"][0] = None
    return shaped


def _choice(
    state: ServeState, body: CompletionRequest, index: int, prompt: Any, r: GenerationResult
) -> CompletionChoice:
    """One finished generation as a choice (the prompt before it with ``echo``; nothing generated with max_tokens 0)."""
    lps = () if body.scores_only else (r.logprobs or ())
    text = "" if body.scores_only else r.text
    if not body.echo:
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=completion_logprobs(lps) if body.logprobs is not None else None,
            finish_reason=finish_name(r.finish_reason),
        )
    scored = r.prompt_logprobs or ()
    if isinstance(prompt, str):
        echoed = prompt
    else:  # token ids decoded together (one by one, a character of several tokens would be cut), as vLLM does
        tok = getattr(state.runtime, "tokenizer", None)
        echoed = tok.decode(prompt, skip_special_tokens=False) if tok is not None else state.runtime.decode(prompt)
    return CompletionChoice(
        index=index,
        text=echoed + text,
        logprobs=echo_logprobs(scored, lps) if body.logprobs is not None else None,
        finish_reason="length" if body.scores_only else finish_name(r.finish_reason),
    )


def _events(state: ServeState, sources: list[Any], rid: str, include_usage: bool, scope_state: Any, n: int) -> Any:
    offsets = [0] * len(sources)
    usages: dict[int, Usage] = {}

    def render(item: tuple[int, StreamChunk]) -> Iterator[bytes]:
        i, c = item
        if c.finish_reason is not None:
            check_finish(c.finish_reason)
        choice = CompletionChoice(
            index=i,
            text=c.text,
            logprobs=completion_logprobs(c.logprobs, offsets[i]),
            finish_reason=finish_name(c.finish_reason) if c.finish_reason else None,
        )
        offsets[i] += len(c.text)
        yield sse(CompletionResponse(id=rid, model=state.name, choices=[choice]))
        if c.finish_reason is not None and c.usage is not None:
            record(state, scope_state, c.usage, c.timings, c.finish_reason, new_prompt=i % n == 0)
            usages[i] = c.usage
            if include_usage and len(usages) == len(sources):
                summed = summed_usage([usages[k] for k in range(len(sources))], n)
                yield sse(
                    CompletionResponse(id=rid, model=state.name, choices=[], usage=UsageWire(**usage_dict(summed)))
                )

    return framed(merged(sources), render)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request) -> Any:
    """Complete a prompt, or a list of prompts as one batch (text or token ids); ``stream: true`` for events.

    ``echo`` + ``logprobs`` (with ``max_tokens: 0``: and nothing generated) score the prompt.
    """
    state = state_of(request.app)
    state.check_model(body.model)
    state.admit(request.state, len(body.prompts()) * body.n)  # every generation counts, before any is tokenized
    info, runtime = state.info, state.runtime
    reqs = body.to_requests(state.defaults, info.unsupported_settings, state.limits.max_tokens)
    rid = new_id("cmpl")
    announce(runtime, len(reqs))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sources = [runtime.aopen(r) for r in reqs]
        events = _events(state, sources, rid, include_usage, request.state, body.n)
        return await start_stream(state, events, "text/event-stream")

    async def run() -> list[GenerationResult]:
        return list(await asyncio.gather(*(acollect(runtime.aopen(r), info.backend) for r in reqs)))

    results = await whole(state, request, run)
    # a scored prompt generates nothing (the one token run to score it is dropped), and is counted so
    usages = [dataclasses.replace(r.usage, completion_tokens=0) if body.scores_only else r.usage for r in results]
    for i, (r, used) in enumerate(zip(results, usages)):
        check_finish(r.finish_reason)
        record(state, request.state, used, r.timings, r.finish_reason, new_prompt=i % body.n == 0)
    choices = [_choice(state, body, i, req.prompt, r) for i, (req, r) in enumerate(zip(reqs, results))]
    usage = UsageWire(**usage_dict(summed_usage(usages, body.n)))
    return CompletionResponse(id=rid, model=state.name, choices=choices, usage=usage)
