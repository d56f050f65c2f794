"""A second Runtime, written outside the package against the core protocol only.

It runs every generation of an inner runtime on a thread of its own and hands over only plain values (it
never hands out the inner runtime or its tokenizer) and it inherits nothing of the package: it implements
``closed``, ``model_info``, ``encode``, ``decode``, ``chat_prompt``, ``open``, ``aopen`` and ``close``, as a
third party's runtime would. Adapters that work over it depend on the core protocol and nothing deeper.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from exllama_integrations.contract.api import (
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    Runtime,
    StreamChunk,
    result_of,
)

_END = object()


class _ProxyStream:
    def __init__(self, inner: Runtime, request: GenerationRequest) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._chunks: list[StreamChunk] = []
        self._backend_name = inner.model_info().backend
        self.result: GenerationResult | None = None
        ready = threading.Event()
        errors: list[BaseException] = []

        def work() -> None:
            try:
                stream = inner.open(request)
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
            self.result = result_of(self._chunks, self._backend_name)
        return item

    def close(self) -> None:
        self._stop.set()

    def __enter__(self) -> _ProxyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ThreadProxyRuntime:
    """Every generation runs on another thread of the inner runtime; values only cross."""

    def __init__(self, inner: Runtime) -> None:
        self._inner = inner

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def model_info(self) -> ModelInfo:
        return self._inner.model_info()

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        return self._inner.encode(text, add_special_tokens, parse_special)

    def decode(self, ids: Sequence[int]) -> str:
        return self._inner.decode(ids)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        return self._inner.chat_prompt(messages, **kwargs)

    def open(self, request: GenerationRequest) -> _ProxyStream:
        return _ProxyStream(self._inner, request)

    async def aopen(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        stream = await asyncio.to_thread(self.open, request)
        try:
            while True:
                chunk = await asyncio.to_thread(next, stream, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            stream.close()

    def close(self) -> None:
        pass  # the inner runtime belongs to someone else
