"""Several generations answered as one OpenAI response: ``n`` choices, or a list of prompts.

They start together, their streams are merged in arrival order, their usage summed as OpenAI sums it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from ...contract.api import Batching, GenerationRequest, Runtime, Usage

T = TypeVar("T")
_END = object()


def per_choice(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """``n`` requests for one prompt, each its own sample.

    A seeded request's choices take seeds seed, seed+1, ... (one seed ``n`` times would give ``n`` equal choices).
    """
    seed = request.settings.seed
    if n == 1:
        return [request]
    return [
        request
        if seed is None or i == 0
        else dataclasses.replace(request, settings=request.settings.model_copy(update={"seed": seed + i}))
        for i in range(n)
    ]


def announce(runtime: Runtime, count: int) -> None:
    """Tell a batching runtime that ``count`` requests arrive together.

    They start as one batch, sharing the prompt's prefix cache where the backend has one.
    """
    if count > 1 and isinstance(runtime, Batching):
        runtime.expect(count)


def summed_usage(usages: Sequence[Usage], per_prompt: int) -> Usage:
    """OpenAI's usage of several choices: each prompt counted once (its first choice's), every completion counted."""
    firsts = usages[::per_prompt]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        completion_tokens=sum(u.completion_tokens for u in usages),
        reasoning_tokens=sum(u.reasoning_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in firsts),
        accepted_draft_tokens=sum(u.accepted_draft_tokens for u in usages),
        rejected_draft_tokens=sum(u.rejected_draft_tokens for u in usages),
    )


async def merged(sources: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several async iterators as ``(index, item)`` in the order they come; an error of any ends it.

    Closing it (or an error) cancels every source, so their generations stop.
    """
    if len(sources) == 1:
        try:
            async for item in sources[0]:
                yield 0, item
        finally:  # a reader that stops (a client gone) stops the generation now, not when this is collected
            await sources[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                await queue.put((i, item, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
            await queue.put((i, None, e))
            return
        await queue.put((i, _END, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in sources:
            with contextlib.suppress(Exception):
                await s.aclose()  # type: ignore[attr-defined]
