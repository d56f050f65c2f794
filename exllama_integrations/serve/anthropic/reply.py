"""A finished chat reply in the Messages API's terms: its tool_use calls, stop reason and usage.

Decided once for the whole answer and the stream. Calls are the outcome's valid calls (the chat layer keeps only
the first with ``disable_parallel_tool_use``); a call that did not read is not a call, its raw text stays text.
``stop_reason``: ``max_tokens`` when the reply was cut, ``tool_use`` when it holds calls, ``stop_sequence``
when one of the request's ``stop_sequences`` ended it, else ``end_turn``. ``input_tokens`` are the prompt tokens
computed, ``cache_read_input_tokens`` those reused from the prefix cache (Anthropic counts the two apart).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...chat.outcome import ChatOutcome, ParsedToolCall
from ...contract.api import Usage
from .protocol import StopReason, UsageOut


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic's clients expect it (``toolu_...``); it comes back in the tool_result as is."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_of(
    outcome: ChatOutcome, calls: Sequence[ParsedToolCall], stops: Sequence[str]
) -> tuple[StopReason, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished reply."""
    if outcome.native_finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    hit = outcome.metadata.get("stop_string")
    if hit is not None and hit in stops:
        return "stop_sequence", hit
    return "end_turn", None


def usage_out(usage: Usage) -> UsageOut:
    """Usage in Anthropic's shape (input tokens computed and read from the cache apart)."""
    return UsageOut(
        input_tokens=usage.prompt_tokens - usage.cached_tokens,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=usage.cached_tokens,
    )


__all__ = ["stop_of", "tool_use_id", "usage_out"]
