"""A load generator that is not the bottleneck: streaming OpenAI requests from several processes at once.

Each worker process runs its share of the streams on one asyncio loop (httpx, one connection per stream),
all starting at the same wall-clock moment, and reports the tokens (the server's usage), when its first
stream started and its last ended, each stream's time to first token, and the CPU time the worker spent,
so a benchmark can say how much of the machine its clients used.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
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


def fresh_prompt(encode: Callable[[str], Sequence[int]], n: int, seed: int) -> str:
    """About ``n`` tokens that begin with a number no other prompt has (so no engine or replica holds any of it)."""
    words = "the quick brown fox jumps over the lazy dog while other animals watch it".split()
    text, i = f"{seed}", 0
    while len(encode(text + " " + words[i % len(words)])) < n:
        text += " " + words[i % len(words)]
        i += 1
    return text


class GpuBusy:
    """nvidia-smi's GPU utilization (the share of time a kernel ran), sampled every 100 ms in the background."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"]
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.split(",")[0])))
            except ValueError:
                pass

    def mean(self, t0: float, t1: float) -> float:
        xs = [u for t, u in self.samples if t0 <= t <= t1]
        return statistics.fmean(xs) if xs else float("nan")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
