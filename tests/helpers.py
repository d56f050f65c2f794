"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def loop_ticks() -> AsyncIterator[list[int]]:
    """Count how often a 10 ms ticker task runs while the block awaits: a blocked event loop barely ticks."""
    ticks = [0]
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks[0] += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    try:
        yield ticks
    finally:
        done.set()
        await task
