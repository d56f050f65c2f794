"""EmbeddingRuntime: one embedding or rerank model loaded in this process, shared by every wrapper built on it.

It is a :class:`~exllama_integrations.contract.api.Runtime` (facts, tokens, templates; asked to generate, it
refuses with :class:`~exllama_integrations.errors.UnsupportedTaskError`) that also :class:`~.contract.retrieval.Embeds`
or :class:`~.contract.retrieval.Reranks`, so a server, the engine's clients and the adapters take it where they take
a chat model's runtime. Inputs are checked and tokenized first (:mod:`.embed_inputs`), every one before any runs;
then computed in batches of at most ``max_batch_size`` inputs and ``max_batch_tokens`` padded tokens, longest first
(less padding), one batch at a time on the backend; the async methods run on the runtime's own worker thread, never
on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

from ...backends.base import build_options
from ...backends.pooling import Encoded, resolve_pooling_backend
from ...contract.api import GenerationRequest, ModelInfo, StreamChunk, TextStream
from ...contract.retrieval import (
    EmbeddingInfo,
    EmbeddingRequest,
    EmbeddingResult,
    RerankHit,
    RerankRequest,
    RerankResult,
    embedder,
    reranker,
)
from ...contract.settings import GenerationSettings
from ...errors import InvalidSettingsError, RuntimeClosedError, UnsupportedTaskError
from ...model.directory import ModelDirectory
from ...model.hub import resolve_model_dir
from ...model.pooling import KIND_OF_TASK, read_pooling, task_of
from ...model.tokenizer import NativeTokenizer
from ..base import RuntimeBase
from .embed_inputs import InputEncoder, check
from .registry import Registry, close_at_exit

if TYPE_CHECKING:
    import numpy as np

    from ...backends.pooling import PoolingBackend, PoolingOptions

logger = logging.getLogger(__name__)
_registry: Registry[EmbeddingRuntime] = Registry(lambda rt: not rt.closed)


class PoolingPlan(NamedTuple):
    """An embedding or rerank model's load resolved before anything loads (handed down as it is)."""

    model: ModelDirectory
    pooling: Any
    backend: type[PoolingBackend]
    options: PoolingOptions


def plan_pooling(
    model_dir: str | os.PathLike[str],
    backend: str,
    task: str | None,
    values: Mapping[str, Any],
    model: ModelDirectory | None = None,
) -> PoolingPlan:
    """The directory inspected (unless given), its pooling read for ``task``, the backend resolved, its options.

    Raises:
        UnsupportedTaskError: the directory holds a text-generation model and no task was given.
        ModelLoadError / InvalidSettingsError: the directory or an option is refused.
    """
    model = model or ModelDirectory.inspect(resolve_model_dir(model_dir))
    pooling = read_pooling(model, task)
    if pooling.task == "generate":
        raise UnsupportedTaskError(
            f"{model.name!r} is a text-generation model (no sentence-transformers config, no classification head); "
            "load it with ExLlamaRuntime, or say task='embed' (last-token pooling) or task='rerank' (yes/no)."
        )
    cls = resolve_pooling_backend(backend, model, pooling)
    options = cls.resolve_options(build_options(cls.Options, cls.name, values))  # type: ignore[arg-type]
    return PoolingPlan(model, pooling, cls, options)  # type: ignore[arg-type]


class EmbeddingRuntime(RuntimeBase):
    """An embedding or rerank model loaded once, shared by the LangChain and LlamaIndex classes and a server.

    Example:
        >>> rt = EmbeddingRuntime.shared(embedding_model_dir())  # doctest: +SKIP
        >>> rt.embed(EmbeddingRequest(["a cat sits", "a dog runs"])).dimensions  # doctest: +SKIP
        384
        >>> rr = EmbeddingRuntime.shared("path/to/cross-encoder")  # doctest: +SKIP
        >>> rr.rerank(RerankRequest("cats", ["a cat", "a car"], top_n=1)).hits  # doctest: +SKIP
        (RerankHit(index=0, score=0.98),)
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        backend: str = "auto",
        *,
        kind: str | None = None,
        task: str | None = None,
        max_seq_len: int | None = None,
        dtype: str | None = None,
        device: str | None = None,
        plan: PoolingPlan | None = None,
        **backend_options: Any,
    ) -> None:
        """Load ``model_dir`` to embed or rerank (``kind``: ``"embedding"`` or ``"rerank"``; else its files say).

        ``task=`` is ``kind``'s old, deprecated name (``"embed"``, ``"rerank"``).

        ``max_seq_len``: read at most this many tokens of an input (default: the model's limit).
        ``plan``: the load resolved already (:func:`plan_pooling`, a server's plan): loaded as it is, the directory
        not inspected again (``max_seq_len`` the plan options').

        Raises:
            UnsupportedTaskError: the directory holds a text-generation model and no task was given.
            ModelLoadError: the directory cannot be loaded (nothing stays loaded).
            MissingDependencyError / BackendUnavailableError: the backend cannot run here.
            InvalidSettingsError: an unknown or invalid load option, or ``kind``.
        """
        task = task_of(kind, task)
        if plan is not None:
            if backend_options or max_seq_len or dtype or device:
                raise InvalidSettingsError("a runtime loaded from a plan takes the plan's load options, not others.")
            max_seq_len = plan.options.max_seq_len
        values = {"dtype": dtype, "device": device, **backend_options}
        model, pooling, cls, options = plan or plan_pooling(model_dir, backend, task, values)
        self.model, self.pooling, self.options = model, pooling, options
        self.settings = GenerationSettings()
        self.tokenizer = NativeTokenizer(model)
        limit = min(max_seq_len or pooling.max_tokens, pooling.max_tokens)
        self._inputs = InputEncoder(model, pooling, self.tokenizer, limit)
        t0 = time.perf_counter()
        self._backend: PoolingBackend | None = cls(model, pooling, options, self._inputs.tokens)
        self.backend_name = cls.name
        self.load_seconds = time.perf_counter() - t0
        self._closed = False
        self._key: tuple[Any, ...] | None = None
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exllama-embed")
        matryoshka = options.matryoshka_dimensions
        self._einfo = EmbeddingInfo(
            name=model.name,
            task=pooling.task,  # type: ignore[arg-type]
            backend=cls.name,
            max_tokens=limit,
            dimensions=self._backend.dimensions,
            normalized=pooling.normalize,
            pooling=pooling.pooling,
            matryoshka_dimensions=pooling.matryoshka_dimensions if matryoshka is None else tuple(matryoshka),
            prompts=dict(pooling.prompts),
            max_batch_size=options.max_batch_size,
        )
        self._info = self._model_info()
        close_at_exit(self)
        logger.info("loaded %s to %s on %s in %.1fs", model.name, pooling.task, cls.name, self.load_seconds)

    @classmethod
    def shared(
        cls,
        model_dir: str | os.PathLike[str],
        backend: str = "auto",
        *,
        kind: str | None = None,
        task: str | None = None,
        **options: Any,
    ) -> EmbeddingRuntime:
        """The loaded runtime for this directory, backend, kind and options, loading it on first use."""
        task = task_of(kind, task)
        values = {k: v for k, v in options.items() if k != "max_seq_len"}
        model, pooling, backend_cls, resolved = plan_pooling(model_dir, backend, task, values)
        key = (str(model.path), backend_cls.name, pooling.task, resolved.key(), options.get("max_seq_len"))

        def load() -> EmbeddingRuntime:
            rt = cls(model.path, backend_cls.name, kind=KIND_OF_TASK[pooling.task], **options)
            rt._key = key
            return rt

        return _registry.get_or_load(key, load)

    # ----------------------------------------------------------------- facts

    def _model_info(self) -> ModelInfo:
        backend = self._require()
        return ModelInfo(
            name=self.model.name,
            backend=self.backend_name,
            context_length=self._einfo.max_tokens,
            vocab_size=self.tokenizer.vocab_size,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            bos_token_id=self.tokenizer.bos_token_id,
            has_chat_template=self.tokenizer.chat_template is not None,
            max_batch_size=self.options.max_batch_size,
            details={
                "task": self.pooling.task,
                "pooling": self._einfo.pooling,
                "dimensions": self._einfo.dimensions,
                "model_dir": str(self.model.path),
                "load_seconds": round(self.load_seconds, 3),
                **backend.info(),
            },
        )

    def model_info(self) -> ModelInfo:
        """Facts about the loaded model (``details["task"]``: what it does)."""
        self._require()
        return self._info

    def embedding_info(self) -> EmbeddingInfo:
        """What the model does: task, dimensions, token limit, normalisation, prompts."""
        self._require()
        return self._einfo

    def tokenizer_files(self) -> dict[str, Any]:
        """The tokenizer's files as plain data (what a server shares with RemoteRuntime)."""
        from ...model.tokenizer_files import TokenizerFiles

        return TokenizerFiles.bundle(self.model)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _require(self) -> PoolingBackend:
        backend = self._backend
        if self._closed or backend is None:
            raise RuntimeClosedError(
                f"the runtime for {self.model.name!r} was closed; build a new one to load it again."
            )
        return backend

    # ----------------------------------------------------------------- work

    def _batches(self, items: Sequence[Encoded]) -> list[list[int]]:
        """Indexes of ``items`` in batches: longest first, within the batch size and the padded-token budget."""
        order = sorted(range(len(items)), key=lambda i: -len(items[i].ids))
        out: list[list[int]] = []
        for i in order:
            if out and len(out[-1]) < self.options.max_batch_size:
                width = len(items[out[-1][0]].ids)  # the batch's longest: its first
                if width * (len(out[-1]) + 1) <= self.options.max_batch_tokens:
                    out[-1].append(i)
                    continue
            out.append([i])
        return out

    def _compute(
        self,
        items: Sequence[Encoded],
        run: Callable[[Sequence[Encoded]], np.ndarray],
        cancel: threading.Event | None = None,
    ) -> np.ndarray:
        import numpy as np

        parts: dict[int, Any] = {}
        for batch in self._batches(items):
            check(cancel)
            with self._lock:  # one batch at a time on the model; callers' batches interleave
                self._require()
                values = run([items[i] for i in batch])
            for row, i in enumerate(batch):
                parts[i] = values[row]
        return np.stack([parts[i] for i in range(len(items))])

    def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Vectors of the request's inputs, in their order.

        Raises:
            UnsupportedTaskError: the model reranks and does not embed.
            InputTooLongError: an input is longer than the model reads and truncation was not asked for.
            InvalidSettingsError: ``dimensions`` the model was not trained to be cut to.
        """
        return self._embed(request, None)

    def _embed(self, request: EmbeddingRequest, cancel: threading.Event | None) -> EmbeddingResult:
        import numpy as np

        info = self.embedding_info()
        if info.task != "embed":
            embedder(self)
        info.check_dimensions(request.dimensions)
        items = self._inputs.texts(request, cancel)
        backend = self._require()
        vectors = self._compute(items, backend.embed, cancel).astype(np.float32)
        if request.dimensions is not None and request.dimensions < vectors.shape[1]:
            vectors = vectors[:, : request.dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        data = np.ascontiguousarray(vectors, dtype="<f4").tobytes()
        tokens = sum(len(e.ids) for e in items)
        return EmbeddingResult(data, vectors.shape[0], vectors.shape[1], tokens, self.model.name)

    def rerank(self, request: RerankRequest) -> RerankResult:
        """The documents' indexes by relevance to the query, best first (``top_n`` of them).

        Raises:
            UnsupportedTaskError: the model embeds and does not rerank.
            InputTooLongError: a (query, document) pair is longer than the model reads, without truncation.
        """
        return self._rerank(request, None)

    def _rerank(self, request: RerankRequest, cancel: threading.Event | None) -> RerankResult:
        if self.embedding_info().task != "rerank":
            reranker(self)
        if not request.documents:
            return RerankResult((), 0, self.model.name)
        items = self._inputs.pairs(request, cancel)
        scores = self._compute(items, self._require().score, cancel).astype(float).reshape(-1)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: request.top_n]
        hits = tuple(RerankHit(i, float(scores[i])) for i in order)
        return RerankResult(hits, sum(len(e.ids) for e in items), self.model.name)

    async def aembed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """Async :meth:`embed`, computed on the runtime's worker thread; cancelled, it stops at its next step."""
        if self.embedding_info().task != "embed":
            embedder(self)
        return await self._on_worker(self._embed, request)

    async def arerank(self, request: RerankRequest) -> RerankResult:
        """Async :meth:`rerank`, computed on the runtime's worker thread; cancelled, it stops at its next step."""
        return await self._on_worker(self._rerank, request)

    async def _on_worker(self, work: Callable[[Any, threading.Event], Any], request: Any) -> Any:
        """``work(request, cancel)`` on the worker thread.

        ``cancel`` is set when the awaiting task is cancelled (a server's client went away): the work stops between
        two chunks of tokenizing or two batches (raising :class:`.embed_inputs.Abandoned`, which nobody awaits).
        """
        cancel = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(self._executor, work, request, cancel)
        try:
            return await future
        except asyncio.CancelledError:
            cancel.set()
            raise

    # ----------------------------------------------------------------- what it does not do

    def _no_generation(self) -> UnsupportedTaskError:
        return UnsupportedTaskError(
            f"model {self.model.name!r} is {'an embedding' if self.pooling.task == 'embed' else 'a rerank'} model; "
            f"it does not generate text. Send it to /v1/{'embeddings' if self.pooling.task == 'embed' else 'rerank'}"
            ", or serve a chat model for chat."
        )

    def open(self, request: GenerationRequest) -> TextStream:
        """Refused: this model does not generate.

        Raises:
            UnsupportedTaskError: always.
        """
        raise self._no_generation()

    async def aopen(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Refused: this model does not generate.

        Raises:
            UnsupportedTaskError: always.
        """
        raise self._no_generation()
        yield  # pragma: no cover - an async generator that refuses at its first step

    def close(self) -> None:
        """Free the model. Idempotent; always returns (a batch in flight finishes first)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            backend, self._backend = self._backend, None
        if self._key is not None:
            _registry.forget(self._key, self)
        if backend is not None:
            backend.close()
        self._executor.shutdown(wait=False)

    def __enter__(self) -> EmbeddingRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "loaded"
        return f"EmbeddingRuntime({str(self.model.path)!r}, kind={KIND_OF_TASK[self.pooling.task]!r}, {state})"


__all__ = ["EmbeddingRuntime"]
