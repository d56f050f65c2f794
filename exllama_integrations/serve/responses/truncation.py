"""``truncation: "auto"``: the oldest input items dropped to fit the context, only when the conversation is over it.

OpenAI's meaning: "if the input to this Response exceeds the model's context window size, the model will truncate
the response to fit the context window by dropping items from the beginning of the conversation" (``disabled``, the
default: a conversation over the context is a 400). Items are dropped a turn at a time (from the start of ``input``
up to the next user message, so a call and its output go together and the conversation still opens with the user),
never ``instructions`` nor the last user turn; the fewest turns that make it fit are found by a binary search over
them (a few renders, not one a turn). The response says so: ``truncation: "auto"`` and ``truncated_input_items``
(how many items were dropped). A conversation whose last turn alone is over the context is refused as it would be
without truncation.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .convert import to_chat
from .protocol import MessageItem

if TYPE_CHECKING:
    from ...chat.prepare import PreparedChat
    from ..state import ServeState
    from .protocol import ResponsesRequest


async def fitted(state: ServeState, body: ResponsesRequest) -> tuple[PreparedChat, int]:
    """``body`` prepared, and how many of its items were dropped.

    Its oldest turns are dropped where ``truncation: "auto"`` and it does not fit.
    """
    prepared = await state.prepare(body, to_chat)
    if body.truncation != "auto" or isinstance(body.input, str) or await _fits(state, prepared):
        return prepared, 0
    starts = [i for i, item in enumerate(body.input) if i > 0 and isinstance(item, MessageItem) and item.role == "user"]
    best: tuple[PreparedChat, int] | None = None
    low, high = 0, len(starts) - 1  # drop the items before starts[k]: the fewest k that fits
    while low <= high:
        mid = (low + high) // 2
        shorter = await state.prepare(body.model_copy(update={"input": body.input[starts[mid] :]}), to_chat)
        if await _fits(state, shorter):
            best, high = (shorter, starts[mid]), mid - 1
        else:
            low = mid + 1
    return best or (prepared, 0)


async def _fits(state: ServeState, prepared: PreparedChat) -> bool:
    """Whether the prompt and the tokens asked for fit the context (as the runtime will check it)."""
    prompt = prepared.prompt
    tokens = len(prompt) if not isinstance(prompt, str) else len(await asyncio.to_thread(state.runtime.encode, prompt))
    want = prepared.request.settings.max_new_tokens
    context = state.info.context_length
    return tokens < context if want is None else tokens + want <= context


__all__ = ["fitted"]
