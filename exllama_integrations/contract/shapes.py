"""Contract values in OpenAI's shapes: finish names, usage, logprobs, and the metadata every adapter reports.

The one place these shapes are written: the OpenAI endpoints, LangChain's ``response_metadata`` /
``generation_info`` and LlamaIndex's ``raw`` all read them from here, so a finished generation is
described the same way through every door.

Finish reasons: the runtime's own (``eos``, ``stop``, ``length``, ``cancelled``) are reported OpenAI-style
in ``finish_reason`` (``stop`` for an end-of-sequence token, a stop string or a stop id; ``length``;
``tool_calls`` when the reply is tool calls; ``cancelled`` when the generation was stopped before it
ended) and as they are in ``native_finish_reason``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .api import GenerationResult, StreamChunk, TokenLogprob, Usage

OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}
"""The one map from the runtime's finish reasons to OpenAI's names."""


def finish_name(native: str, tool_calls: bool = False) -> str:
    """OpenAI's name for a finish reason (``tool_calls`` when the reply is tool calls)."""
    return "tool_calls" if tool_calls else OPENAI_FINISH.get(native, native)


def usage_dict(usage: Usage) -> dict[str, Any]:
    """Usage in OpenAI's shape, with the details a reasoning model and a prefix cache add.

    ``{"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"},
    "completion_tokens_details": {"reasoning_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens"}}``
    (the last two: drafted tokens the model accepted and rejected, where a drafter served the request).
    """
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "accepted_prediction_tokens": usage.accepted_draft_tokens,
            "rejected_prediction_tokens": usage.rejected_draft_tokens,
        },
    }


def logprobs_content(lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Logprobs in OpenAI's chat shape: ``[{"token", "logprob", "top_logprobs": [{"token", "logprob"}]}]``."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": list(lp.token.encode()),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in lp.top],
        }
        for lp in lps
    ]


def chat_logprobs(lps: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
    """Logprobs in the chat API's shape (``{"content": [...]}``), or None."""
    return None if lps is None else {"content": logprobs_content(lps)}


def completion_logprobs(lps: Sequence[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """Logprobs in the completions API's shape (tokens, token_logprobs, top_logprobs, text_offset).

    Each position's ``top_logprobs`` holds the chosen token too, as OpenAI and vLLM answer it ("up to logprobs + 1
    elements"): with ``logprobs: 0``, the chosen token alone.
    """
    if lps is None:
        return None
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{**{t.token: t.logprob for t in lp.top}, lp.token: lp.logprob} for lp in lps],
        "text_offset": offsets,
    }


def metadata(
    final: StreamChunk | GenerationResult,
    *,
    model_name: str,
    backend: str,
    tool_calls: bool = False,
    logprobs: Sequence[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """The one mapping from a finished generation to framework metadata (same keys in every adapter).

    ``usage`` (OpenAI's shape, with reasoning and cached-token details), ``finish_reason`` (OpenAI's name),
    ``native_finish_reason``, timings, ``stop_string`` and ``constraint_complete`` when set, and ``logprobs``
    in OpenAI's chat shape when given.
    """
    assert final.finish_reason is not None and final.usage is not None and final.timings is not None
    d: dict[str, Any] = {
        "model_name": model_name,
        "backend": backend,
        "finish_reason": finish_name(final.finish_reason, tool_calls),
        "native_finish_reason": final.finish_reason,
        "usage": usage_dict(final.usage),
        "time_to_first_token": final.timings.time_to_first_token,
        "tokens_per_second": final.timings.tokens_per_second,
    }
    if final.stop_string is not None:
        d["stop_string"] = final.stop_string
    if final.constraint_complete is not None:
        d["constraint_complete"] = final.constraint_complete
    if logprobs is not None:
        d["logprobs"] = chat_logprobs(logprobs)
    return d


__all__ = [
    "OPENAI_FINISH",
    "chat_logprobs",
    "completion_logprobs",
    "finish_name",
    "logprobs_content",
    "metadata",
    "usage_dict",
]
