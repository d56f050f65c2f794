"""A second, minimal Runtime: a proxy that runs every call of an inner runtime on its own thread.

It implements the Runtime protocol from plain values only (it never hands out the inner runtime or
its tokenizer), so adapters that work over it depend on the contract and nothing deeper.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from exllama_integrations.runtime._common import RuntimeCommon
from exllama_integrations.runtime.api import (
    GenerationResult,
    Grammar,
    ModelInfo,
    Prompt,
    Runtime,
    StreamChunk,
    result_of,
)
from exllama_integrations.runtime.settings import GenerationSettings

_END = object()


class _ProxyStream:
    def __init__(self, inner: Runtime, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._chunks: list[StreamChunk] = []
        self._backend = inner.model_info().backend
        self.result: GenerationResult | None = None
        ready = threading.Event()
        errors: list[BaseException] = []

        def work() -> None:
            try:
                stream = inner.stream(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                errors.append(e)
                ready.set()
                return
            ready.set()
            try:
                with stream:
                    for chunk in stream:
                        self._q.put(chunk)
                        if self._stop.is_set():
                            break
            except BaseException as e:  # noqa: BLE001
                self._q.put(e)
            self._q.put(_END)

        threading.Thread(target=work, name="proxy-stream", daemon=True).start()
        ready.wait()
        if errors:
            raise errors[0]

    def __iter__(self) -> _ProxyStream:
        return self

    def __next__(self) -> StreamChunk:
        item = self._q.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self._chunks.append(item)
        if item.finish_reason is not None:
            self.result = result_of(self._chunks, self._backend)
        return item

    def close(self) -> None:
        self._stop.set()

    def __enter__(self) -> _ProxyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ThreadProxyRuntime(RuntimeCommon):
    """Every call runs on another thread of the inner runtime; values only cross."""

    def __init__(self, inner: Runtime) -> None:
        self._inner = inner
        self.settings = GenerationSettings()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def model_info(self) -> ModelInfo:
        return self._inner.model_info()

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        return self._inner.encode(text, add_special_tokens, parse_special)

    def count_tokens(self, text: str) -> int:
        return self._inner.count_tokens(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._inner.decode(ids)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        return self._inner.chat_prompt(messages, **kwargs)

    def stream(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        incremental: bool = True,
        **overrides: Any,
    ) -> _ProxyStream:
        s = self.resolve_settings(settings, **overrides)
        kw = {"grammar": grammar, "add_special_tokens": add_special_tokens, "incremental": incremental}
        return _ProxyStream(self._inner, (prompt, s), kw)

    async def astream(
        self,
        prompt: Prompt,
        settings: GenerationSettings | None = None,
        *,
        grammar: Grammar | None = None,
        add_special_tokens: bool = True,
        incremental: bool = True,
        **overrides: Any,
    ) -> AsyncIterator[StreamChunk]:
        kw = {"grammar": grammar, "add_special_tokens": add_special_tokens, "incremental": incremental}
        stream = await asyncio.to_thread(self.stream, prompt, settings, **kw, **overrides)
        try:
            while True:
                chunk = await asyncio.to_thread(next, stream, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            stream.close()

    def batch(self, prompts: Sequence[Prompt], settings: GenerationSettings | None = None, **kw: Any) -> list[Any]:
        return [self.generate(p, settings, **kw) for p in prompts]

    def close(self) -> None:
        pass  # the inner runtime belongs to someone else
