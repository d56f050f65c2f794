"""A load generator that is not the bottleneck: streaming OpenAI requests from several processes at once.

Each worker process runs its share of the streams on one asyncio loop (httpx, one connection per stream),
all starting at the same wall-clock moment, and reports the tokens (the server's usage), when its first
stream started and its last ended, each stream's time to first token, and the CPU time the worker spent,
so a benchmark can say how much of the machine its clients used.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any


async def _one(client: Any, url: str, body: dict[str, Any]) -> tuple[int, float, float, float]:
    t0 = time.time()
    first = None
    tokens = 0
    if not body.get("stream"):  # a whole body: its "time to first token" is its latency
        reply = await client.post(url, json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {reply.text[:300]!r}")
        end = time.time()
        return int(reply.json()["usage"]["completion_tokens"]), t0, end, end - t0
    async with client.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            choices = event.get("choices") or ()
            if first is None and choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
                first = time.time()
    end = time.time()
    return tokens, t0, end, (first or end) - t0


def run_streams(
    base_url: str, prompts: list[str], max_tokens: int, start_at: float, stream: bool = True
) -> dict[str, Any]:
    """Stream ``prompts`` through ``/v1/completions`` together, from ``start_at`` (a ``time.time()``);
    ``stream=False``: ask for whole bodies instead."""
    import httpx

    cpu0 = time.process_time()

    async def main() -> list[tuple[int, float, float, float]]:
        limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            delay = start_at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            bodies = [dict(body, prompt=p) for p in prompts]
            return await asyncio.gather(*(_one(client, base_url + "/v1/completions", b) for b in bodies))

    rows = asyncio.run(main())
    return {
        "tokens": sum(r[0] for r in rows),
        "start": min(r[1] for r in rows),
        "end": max(r[2] for r in rows),
        "ttfts": [r[3] for r in rows],
        "cpu": time.process_time() - cpu0,
    }


def warm() -> bool:
    """Import what a worker needs (so the first timed row does not pay for it)."""
    import httpx  # noqa: F401

    return True
