"""The one configuration LangChain's and LlamaIndex's embedding and rerank classes share, and the calls they make.

Rules decided here, once, for the four classes (``ExLlamaEmbeddings`` / ``ExLlamaRerank`` in LangChain,
``ExLlamaEmbedding`` / ``ExLlamaRerank`` in LlamaIndex):

* Where the model is (checked in :mod:`._model_source`): exactly one of ``model_dir=`` (loaded in this process by
  :class:`~exllama_integrations.runtime.local.EmbeddingRuntime`, shared; ``model=`` is accepted as its name),
  ``base_url=`` (a server's model, through :class:`~exllama_integrations.runtime.remote.RemoteRuntime`; with
  ``model=``, that one of a server of several) or
  ``runtime=`` (any runtime with the :class:`~.contract.retrieval.Embeds` or ``Reranks`` capability). A runtime
  whose model does not do the class's task is refused when the class is built, with
  :class:`~exllama_integrations.errors.UnsupportedTaskError`.
* Documents are embedded as ``input_type="document"`` and queries as ``"query"``, so a model's own prompts (a
  Qwen3-Embedding query instruction) are applied the same way at every door; ``truncate`` and ``dimensions`` are
  the request's.
* More inputs (or documents) than one request may carry (``MAX_INPUTS``, 2048, as OpenAI's endpoint allows) are
  sent as several requests, in order; a rerank's hits are merged (each pair is scored on its own) and cut to
  ``top_n`` once (``InMemoryVectorStore.from_texts`` takes more than 2048 texts).
* Unknown arguments are refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import get_close_matches
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError

from ._model_source import check_one_place, server_runtime
from .contract.retrieval import MAX_INPUTS, EmbeddingRequest, RerankHit, RerankRequest, embedder, reranker
from .errors import InvalidSettingsError


class RetrievalConfig(BaseModel):
    """Fields shared by the embedding and rerank classes (not a framework class)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), use_attribute_docstrings=True)

    task: ClassVar[str] = "embed"

    model_dir: str | None = None
    """An embedding or rerank model's directory (or Hugging Face Hub id), loaded in this process."""
    base_url: str | None = None
    """An exllama-integrations server of an embedding or rerank model (``http://127.0.0.1:8000``)."""
    server_model: str | None = None
    """With ``base_url=``: which of the server's models (its name in ``/v1/models``; ``model=`` sets it); None: the
    server's first."""
    api_key: SecretStr | None = None
    """Bearer key for ``base_url``'s server (or set ``EXLLAMA_API_KEY``)."""
    runtime: Any = Field(default=None, exclude=True)
    """Any runtime that embeds (or reranks) to use as it is."""
    backend: str = "auto"
    """``auto`` (exllamav3 on CUDA for decoder models, else transformers), ``exllamav3`` or ``transformers``."""
    shared_runtime: bool = True
    """Reuse the runtime already loaded for this directory and options (True), or load a private one."""
    model_kind: Literal["embedding", "rerank"] | None = None
    """What to load a model directory as when its files do not say: ``"embedding"`` (a causal LM with last-token
    pooling, Qwen3-Embedding style) or ``"rerank"`` (a causal LM's yes/no logits, Qwen3-Reranker style). None: found
    from the files. The same word as ``EmbeddingRuntime(kind=)``, ``serve --kind`` and a server's config entries."""
    model_task: str | None = None
    """Deprecated: ``model_kind``'s old name (``"embed"``, ``"rerank"``); it works and warns with what to write."""
    max_seq_len: int | None = None
    """Read at most this many tokens of an input (default: the model's limit)."""
    dtype: str | None = None
    """Weights dtype (transformers on CPU: float32)."""
    device: str | None = None
    """Device (``cpu``, ``cuda:0``)."""
    backend_options: dict[str, Any] = Field(default_factory=dict)
    """Load options (``max_batch_size``, ``max_batch_tokens``, ``num_threads``, ``matryoshka_dimensions``)."""
    truncate: bool = False
    """Keep an over-long input's first tokens instead of raising InputTooLongError."""

    _runtime: Any = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        """Validate the arguments, then load (or borrow) the runtime and check that its model does the task.

        Raises:
            InvalidSettingsError: an unknown argument, or not exactly one of model_dir, base_url and runtime.
            UnsupportedTaskError: the model does not do this class's task.
        """
        if "model" in data and data.get("base_url"):
            data.setdefault("server_model", data.pop("model"))  # a model of a server of several
        elif "model" in data and not data.get("runtime"):
            data.setdefault("model_dir", data.pop("model"))
        known = {k for name, f in type(self).model_fields.items() for k in (name, f.alias) if k}
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            hints = ", ".join(
                f"{k!r}" + "".join(f" (did you mean {c!r}?)" for c in get_close_matches(k, known, 1)) for k in unknown
            )
            raise InvalidSettingsError(f"unknown argument(s) for {type(self).__name__}: {hints}.")
        try:
            super().__init__(**data)
        except ValidationError as e:
            lines = [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
            raise InvalidSettingsError(f"invalid arguments for {type(self).__name__}: " + "; ".join(lines)) from None
        self._runtime = self._open_runtime()
        (embedder if self.task == "embed" else reranker)(self._runtime)
        self._loaded()

    def _loaded(self) -> None:
        """Called once the runtime is there (a class fills in what it reads from the model)."""

    def _open_runtime(self) -> Any:
        check_one_place(self)
        if self.runtime is not None:
            return self.runtime
        if self.base_url:
            return server_runtime(self)
        from .runtime.local import EmbeddingRuntime

        factory = EmbeddingRuntime.shared if self.shared_runtime else EmbeddingRuntime
        options: dict[str, Any] = {"max_seq_len": self.max_seq_len, "dtype": self.dtype, "device": self.device}
        options = {k: v for k, v in options.items() if v is not None}
        assert self.model_dir is not None
        kind: str | None = self.model_kind
        if self.model_task is not None:
            from .model.pooling import kind_of_old_task

            kind = kind_of_old_task(self.model_task, kind, f"{type(self).__name__}(model_task=", "model_kind")
        if kind is not None:
            options["kind"] = kind
        return factory(self.model_dir, self.backend, **options, **self.backend_options)

    @property
    def exllama_runtime(self) -> Any:
        """The runtime this class uses."""
        return self._runtime

    # ----------------------------------------------------------------- the calls, decided once

    def _request(self, texts: Sequence[str], input_type: str, dimensions: int | None) -> EmbeddingRequest:
        return EmbeddingRequest(tuple(texts), input_type=input_type, truncate=self.truncate, dimensions=dimensions)  # type: ignore[arg-type]

    def _embed(self, texts: Sequence[str], input_type: str, dimensions: int | None = None) -> list[list[float]]:
        runtime = embedder(self._runtime)
        return [v for part in _parts(texts) for v in runtime.embed(self._request(part, input_type, dimensions)).vectors]

    async def _aembed(self, texts: Sequence[str], input_type: str, dimensions: int | None = None) -> list[list[float]]:
        runtime = embedder(self._runtime)
        out: list[list[float]] = []
        for part in _parts(texts):
            out += (await runtime.aembed(self._request(part, input_type, dimensions))).vectors
        return out

    def _rerank_request(self, query: str, documents: Sequence[str], top_n: int | None) -> RerankRequest:
        return RerankRequest(query, tuple(documents), top_n, self.truncate)

    def _rerank(self, query: str, documents: Sequence[str], top_n: int | None) -> tuple[RerankHit, ...]:
        runtime = reranker(self._runtime)
        if len(documents) <= MAX_INPUTS:
            return runtime.rerank(self._rerank_request(query, documents, top_n)).hits if documents else ()
        parts = [runtime.rerank(self._rerank_request(query, p, None)).hits for p in _parts(documents)]
        return _merged(parts, top_n)

    async def _arerank(self, query: str, documents: Sequence[str], top_n: int | None) -> tuple[RerankHit, ...]:
        runtime = reranker(self._runtime)
        if len(documents) <= MAX_INPUTS:
            return (await runtime.arerank(self._rerank_request(query, documents, top_n))).hits if documents else ()
        parts = [(await runtime.arerank(self._rerank_request(query, p, None))).hits for p in _parts(documents)]
        return _merged(parts, top_n)


def _parts(items: Sequence[str]) -> list[Sequence[str]]:
    """``items`` in runs of at most ``MAX_INPUTS`` (what one request may carry), in order; none for none."""
    return [items[i : i + MAX_INPUTS] for i in range(0, len(items), MAX_INPUTS)]


def _merged(parts: Sequence[Sequence[RerankHit]], top_n: int | None) -> tuple[RerankHit, ...]:
    """The hits of consecutive runs of documents as one ranking: indexes into the whole list, best first, ``top_n``."""
    hits = [RerankHit(h.index + i * MAX_INPUTS, h.score) for i, part in enumerate(parts) for h in part]
    return tuple(sorted(hits, key=lambda h: (-h.score, h.index))[:top_n])


__all__ = ["RetrievalConfig"]
