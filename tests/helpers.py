"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

THINKS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
"""A chat template whose generation prompt opens a thinking block (DeepSeek-R1's shape): SmolLM2 then "thinks"."""

# the OpenAI-shaped tool the tool-calling tests ask the demo model to call
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@dataclass
class LoopWatch:
    """How freely the event loop ran while a block awaited."""

    ticks: int = 0
    gaps: list[float] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def longest_gap(self) -> float:
        return max(self.gaps, default=self.elapsed)

    def assert_free(self) -> None:
        """The loop kept ticking: no stall took more than half of the block's time (a blocked loop stalls for all of
        it). Robust on a slow, busy machine: it compares the loop with itself, not with a clock budget."""
        assert self.ticks >= 3, f"the loop ticked {self.ticks} times in {self.elapsed:.2f}s"
        assert self.longest_gap < 0.5 * self.elapsed, (
            f"the event loop stalled for {self.longest_gap:.2f}s of {self.elapsed:.2f}s"
        )


@contextlib.asynccontextmanager
async def loop_ticks() -> AsyncIterator[LoopWatch]:
    """Run a 10 ms ticker task while the block awaits, recording the gaps between its ticks."""
    watch = LoopWatch()
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            watch.ticks += 1
            watch.gaps.append(now - last)
            last = now

    t0 = time.perf_counter()
    task = asyncio.create_task(ticker())
    try:
        yield watch
    finally:
        watch.elapsed = time.perf_counter() - t0
        done.set()
        await task


def run_isolated(code: str, timeout: float = 120, memory_mb: int | None = None, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter with a time limit (and an address-space cap); return the JSON it prints.

    A regression that hangs or eats memory fails here instead of hanging or killing the test run.
    """
    preexec = None
    if memory_mb is not None:

        def preexec() -> None:
            import resource

            limit = memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=preexec,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"timed out after {timeout}s (hang?); output so far: {e.stdout!r} {e.stderr!r}") from None
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def error_instances() -> list:
    """One instance of every typed error class, with its fields set."""
    from exllama_integrations import errors

    made: list = []
    for cls in errors.ERRORS.values():
        if cls is errors.ContextLengthError:
            made.append(cls(900, 200, 1024))
        elif cls is errors.InputTooLongError:
            made.append(cls(2, 300, 256, "'all-MiniLM-L6-v2'"))
        elif cls is errors.MissingDependencyError:
            made.append(cls("exllamav3", "exllamav3", "the GPU backend"))
        elif issubclass(cls, errors.InvalidSettingsError):
            made.append(cls("bad thing", param="max_tokens", reason="max_tokens_too_large"))
        elif issubclass(cls, errors.ServerError):
            made.append(cls("far away", 502))
        else:
            made.append(cls(f"a {cls.__name__} happened"))
    return made


def decision_questions() -> tuple[str, tuple]:
    """A support message and the three questions (Noul, Choice, Score) the decision tests ask of it."""
    from exllama_integrations.contract.decisions import Choice, Label, Noul, Score, labels

    state = "Production has been down for an hour and our invoices failed to send. Fix it NOW!!!"
    return state, (
        Noul("urgent", "Is this request urgent?"),
        Choice(
            "team",
            "Which team should handle this request?",
            (Label("billing", "Payments and invoices."), Label("technical", "Bugs and outages."), Label("sales")),
        ),
        Score("anger", "How frustrated is the customer?", labels("calm", "concerned", "angry")),
    )


def decode_step(rows: int = 16, **extra: Any) -> tuple[Any, dict[str, Any]]:
    """The forward of one plain decode step as exllamav3's ``Generator.iterate_gen`` calls it: the token ids and the
    ``params`` (a fake of exllamav3's call, for the fast path's capture decisions; torch needed)."""
    import torch

    params = {
        "attn_mode": "flash_attn",
        "block_table": torch.zeros((rows, 16), dtype=torch.int32),
        "cache": object(),
        "cache_seqlens": torch.full((rows,), 130, dtype=torch.int32),
        "recurrent_states": None,
        "indexed_embeddings": [],
        "positions": None,
        "recurrent_history": False,
        "pinned_staging": True,
        "dev_cache": {},
        **extra,
    }
    return torch.ones((rows, 1), dtype=torch.long), params


@contextlib.contextmanager
def plain_and_fast(name: str, fixtures: dict[str, Any], cache_size: int) -> Any:
    """A GPU fixture checkpoint (``fixtures[name]()`` builds it once; the tests skip, saying why, where it cannot be)
    loaded twice: under exllamav3's own loop, and under ``decode="fast"`` (the default). Yields (name, plain, fast)."""
    import pytest

    from exllama_integrations import ExLlamaRuntime

    try:
        path, took = fixtures[name]()
    except Exception as e:  # noqa: BLE001 - the other fixtures' tests still run; the reason is printed
        pytest.skip(f"{name}: the fixture was not built ({type(e).__name__}: {str(e)[:300]})")
    print(f"{name} fixture: {path} {took}")
    with ExLlamaRuntime(path, "exllamav3", cache_size=cache_size, decode="exllamav3") as plain:
        with ExLlamaRuntime(path, "exllamav3", cache_size=cache_size) as fast:
            yield name, plain, fast
