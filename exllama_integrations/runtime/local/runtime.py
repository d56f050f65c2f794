"""ExLlamaRuntime: one model directory loaded in this process, shared by every wrapper built on it."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ...backends import BackendRequest
from ...contract.api import GenerationRequest, ModelInfo, StreamChunk
from ...contract.settings import GenerationSettings
from ...errors import RuntimeClosedError
from ...model.directory import ModelDirectory
from ...model.media import MediaLimits
from ...model.tokenizer import NativeTokenizer
from ..base import RuntimeBase
from .facts import model_facts
from .registry import LoadPlan, Registry, close_at_exit, engine_choice, plan_load
from .requests import RequestMaker
from .run import LocalStream, Run, aiter_run, async_queue

if TYPE_CHECKING:
    from ...backends.base import Backend, BackendOptions

logger = logging.getLogger(__name__)

_registry: Registry[ExLlamaRuntime] = Registry(lambda rt: not rt.closed)

INLINE_PROMPT_CHARS = 8192
"""Prompts up to this long are tokenized on the event loop by ``aopen`` (about a millisecond of work, less
than a hand-off to a thread costs once a decoding thread keeps the GIL busy)."""


class ExLlamaRuntime(RuntimeBase):
    """One model directory loaded once: backend, tokenizer and generation, shared by wrappers.

    Build it directly for a private runtime, or with :meth:`shared` to get the same loaded runtime
    for every caller asking for the same directory, backend and options (what the LangChain and
    LlamaIndex wrappers do). Safe to call from many threads and from asyncio at once; decoding runs
    on the backend's own worker, so a reader that stops reading never holds the model.

    Example:
        >>> rt = ExLlamaRuntime.shared("~/models/SmolLM2-135M-Instruct")  # doctest: +SKIP
        >>> rt.generate("The capital of France is", temperature=0, max_new_tokens=8).text  # doctest: +SKIP
        ' Paris.'
        >>> for chunk in rt.stream("Once upon a time", max_new_tokens=16):  # doctest: +SKIP
        ...     print(chunk.text, end="")
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        backend: str = "auto",
        *,
        max_seq_len: int | None = None,
        dtype: str | None = None,
        device: str | None = None,
        settings: GenerationSettings | None = None,
        engine: str = "thread",
        engines: int = 1,
        plan: LoadPlan | None = None,
        **backend_options: Any,
    ) -> None:
        """Load ``model_dir`` (a directory, or a Hugging Face Hub id) with ``backend``.

        ``backend``: ``auto``, ``exllamav3``, ``exllama``, ``exllamav2`` or ``transformers``; the other
        keyword arguments are the backend's load options (unknown ones are refused by name).

        ``engine``: ``"thread"`` runs the backend's driver in this process; ``"process"`` runs it in an engine
        process of its own (ZeroMQ between them), so nothing else in this process (an HTTP server, framework
        callbacks, your app) shares the driver's Python; templates, tokenizing and detokenizing stay here.
        ``engines``: how many engine processes, each with its own copy of the model and cache, requests
        spread over them by prefix and load (implies ``engine="process"``).
        ``plan``: a load resolved already (a server's): loaded as it is, the directory not inspected again.

        Raises:
            ModelLoadError: (ModelNotFoundError, InvalidModelError, UnsupportedModelError) the directory
                cannot be loaded; nothing stays loaded.
            MissingDependencyError: the backend's extra is not installed.
            BackendUnavailableError: the backend cannot run on this machine.
            InvalidSettingsError: an unknown or invalid load option.
        """
        model, backend_cls, options = plan_load(model_dir, backend, max_seq_len, dtype, device, backend_options, plan)
        self.model: ModelDirectory = model
        self.tokenizer = NativeTokenizer(model)
        self.options: BackendOptions = options
        self.settings = settings or GenerationSettings()
        self._refused = dict(backend_cls.unsupported_settings)
        self.media_limits = MediaLimits()
        """Bounds on a request's images (bytes, pixels, count), checked before any is decoded."""
        engine, engines = engine_choice(engine, engines)
        self.engine = engine
        """Where the backend's driver runs: ``thread`` (this process) or ``process`` (engine processes)."""
        t0 = time.perf_counter()
        self._backend: Backend | None
        if engine == "process":
            from ..engine import EngineBackend

            self._backend = EngineBackend(backend_cls, model, options, engines=engines)
        else:
            self._backend = backend_cls(model, self.tokenizer, options)
        self.backend_name = backend_cls.name
        self.load_seconds = time.perf_counter() - t0
        self._closed = False
        self._key: tuple[Any, ...] | None = None
        self._lock = threading.Lock()
        self._active: set[BackendRequest] = set()
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="exllama-aio")
        self._requests = RequestMaker(model, self.tokenizer, self.backend_name, self.rendered_prompt)
        try:
            self._info = self._model_info()
        except BaseException:
            self._backend.close()  # nothing stays loaded (an engine process included)
            raise
        close_at_exit(self)
        logger.info("loaded %s on %s in %.1fs", model.name, self.backend_name, self.load_seconds)

    # ----------------------------------------------------------------- sharing

    @classmethod
    def shared(
        cls,
        model_dir: str | os.PathLike[str],
        backend: str = "auto",
        *,
        max_seq_len: int | None = None,
        dtype: str | None = None,
        device: str | None = None,
        settings: GenerationSettings | None = None,
        engine: str = "thread",
        engines: int = 1,
        **backend_options: Any,
    ) -> ExLlamaRuntime:
        """The loaded runtime for this directory, backend and options, loading it on first use.

        Every caller whose request resolves to the same directory, backend and options (after
        ``auto`` and defaults are resolved) gets the same object, so an LLM, a chat model and a
        LlamaIndex LLM on one directory load the weights once.
        """
        model, backend_cls, options = plan_load(model_dir, backend, max_seq_len, dtype, device, backend_options)
        engine, engines = engine_choice(engine, engines)
        settings_key = (settings or GenerationSettings()).model_dump_json()
        key = (str(model.path), backend_cls.name, options.key(), settings_key, engine, engines)

        def load() -> ExLlamaRuntime:
            rt = cls(
                model.path,
                backend_cls.name,
                settings=settings,
                engine=engine,
                engines=engines,
                **options.model_dump(exclude_none=True),
            )
            rt._key = key
            return rt

        return _registry.get_or_load(key, load)

    @staticmethod
    def loaded() -> list[ExLlamaRuntime]:
        """Shared runtimes currently loaded."""
        return _registry.live()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def active_requests(self) -> int:
        """Generations submitted and not yet finished or cancelled (what waits for or holds the backend)."""
        with self._lock:
            return len(self._active)

    def cache_use(self) -> tuple[int, int]:
        """KV-cache tokens the generations in flight hold (prompt + max_new_tokens each), and the cache's capacity."""
        info = self.model_info()
        with self._lock:
            used = sum(min(len(r.prompt_ids) + r.max_new_tokens, info.context_length) for r in self._active)
        return used, int(info.details.get("cache_tokens") or info.context_length * max(1, info.max_batch_size))

    def close(self) -> None:
        """Cancel running generations and free the model (GPU memory included). Idempotent; always returns.

        Generations in flight end with ``finish_reason="cancelled"`` after the step in flight.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            active = list(self._active)
        for req in active:
            req.cancel.set()
        if self._key is not None:
            _registry.forget(self._key, self)
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()
        self._executor.shutdown(wait=False)
        self._requests.close()
        logger.info("closed %s (%s)", self.model.name, self.backend_name)

    def __enter__(self) -> ExLlamaRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "loaded"
        return f"ExLlamaRuntime({str(self.model.path)!r}, backend={self.backend_name!r}, {state})"

    # ----------------------------------------------------------------- facts

    def _model_info(self) -> ModelInfo:
        backend = self._require_backend()
        return model_facts(self.model, self.tokenizer, backend, self.backend_name, self.load_seconds, self._refused)

    def model_info(self) -> ModelInfo:
        """Facts about the loaded model (name, backend, context, tokens, template, reasoning, batching, refusals)."""
        self._require_backend()
        return self._info

    @property
    def context_length(self) -> int:
        """Longest prompt + completion the loaded model (and its cache) can hold."""
        return self.model_info().context_length

    @property
    def model_name(self) -> str:
        """The model directory's name."""
        return self.model.name

    def tokenizer_files(self) -> dict[str, Any]:
        """The tokenizer's files as plain data (what the HTTP server shares, so clients count tokens exactly)."""
        from ...model.tokenizer_files import TokenizerFiles

        return TokenizerFiles.bundle(self.model)

    def diagnostics(self) -> dict[str, Any]:
        """The backend's library objects (exllamav3's ``generator``, ``model``, ``cache``, its ``inbox`` ...).

        For tests and benchmarks that measure or probe the library itself: not a stable API, and nothing a
        caller of the runtime needs.
        """
        return {"backend": self.backend_name, **self._require_backend().library_objects()}

    def health(self) -> str | None:
        """Why the runtime cannot take requests now (closed; its engine process died and is starting again), or None."""
        backend = self._backend
        if self._closed or backend is None:
            return "the runtime was closed"
        return backend.health()

    def _require_backend(self) -> Backend:
        backend = self._backend
        if self._closed or backend is None:
            raise RuntimeClosedError(
                f"the runtime for {self.model.name!r} was closed; build a new one to load it again."
            )
        return backend

    # ----------------------------------------------------------------- requests

    def _prepare(self, request: GenerationRequest, put: Any) -> tuple[Run, BackendRequest]:
        """Check and tokenize one request (raising typed errors before anything runs): :mod:`.requests`."""
        return self._requests.prepare(self._require_backend(), self._info, request, put, self.media_limits)

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids the model reads for ``request``, each image counted as the tokens it is read as.

        Nothing is generated; what ``usage.prompt_tokens`` will say before the request runs (the server's
        ``/tokenize``, LangChain's ``get_num_tokens_from_messages``).

        Raises:
            MediaError: images the model does not take, or cannot read.
        """
        return list(self._requests.prompt(self._require_backend(), request, self.media_limits)[0])

    def expect(self, n: int) -> None:
        """``n`` requests of one batch are about to arrive one by one (see :meth:`RuntimeBase.expect`)."""
        backend = self._backend
        if backend is not None and n > 1:
            backend.expect(n)

    def _submit(self, requests: list[BackendRequest]) -> None:
        with self._lock:
            backend = self._require_backend()
            self._active.update(requests)
        backend.submit(requests)

    def _done(self, request: BackendRequest) -> None:
        with self._lock:
            self._active.discard(request)

    def open(self, request: GenerationRequest) -> LocalStream:
        """Start a generation; its stream of chunks. Closing the stream (or ``break``) cancels it within a step.

        ``request.incremental=False`` says the caller wants the whole completion, not its pieces as they come:
        the tokens are handed over when it ends (every few steps while stop strings are watched), which spares
        the decoding thread a wake-up of the reader per token. The chunks and the result are the same.

        Raises:
            InvalidSettingsError: a setting the backend cannot honour, an empty or non-UTF-8 prompt.
            ContextLengthError: prompt + max_new_tokens exceed the context.
            ConstraintError: the grammar does not compile.
            MediaError: images for a model that takes none.
            RuntimeClosedError: the runtime was closed.
        """
        return self.open_batch([request])[0]

    def open_batch(self, requests: Sequence[GenerationRequest]) -> list[LocalStream]:  # type: ignore[override]
        """Start generations together (one dynamic batch on exllamav3). Every request is checked before any runs."""
        prepared = []
        for request in requests:
            steps: queue.SimpleQueue[Any] = queue.SimpleQueue()
            run, backend_request = self._prepare(request, steps.put)
            prepared.append((run, backend_request, steps))
        if prepared:
            self.expect(len(prepared))  # announced, then handed in whole: they start at once, spread over engines
            self._submit([req for _, req, _ in prepared])
        return [LocalStream(run, req, steps, lambda r=req: self._done(r)) for run, req, steps in prepared]  # type: ignore[misc]

    async def aopen(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Async :meth:`open`: decoding runs on the backend's worker, never on the loop.

        A long prompt is tokenized (and a grammar compiled) on the runtime's executor, a short one on the loop,
        where it costs less than the hand-off. Cancelling the consuming task (or closing the async generator)
        cancels the generation.
        """
        steps, put = async_queue()
        prompt = request.prompt
        inline = (
            request.grammar is None
            and not request.messages
            and not request.media
            and (not isinstance(prompt, str) or len(prompt) <= INLINE_PROMPT_CHARS)
        )
        if inline:
            run, backend_request = self._prepare(request, put)
        else:
            loop = asyncio.get_running_loop()
            run, backend_request = await loop.run_in_executor(self._executor, self._prepare, request, put)
        self._submit([backend_request])
        try:
            async for chunk in aiter_run(run, steps):
                yield chunk
        finally:  # synchronous, so a closed or cancelled reader frees the backend at once
            backend_request.cancel.set()
            self._done(backend_request)
