"""Embedding and rerank as contract values: the requests, the results, the model's facts, the capabilities.

An :class:`EmbeddingRequest` (texts or token ids, the input's role, truncation, Matryoshka dimensions) gives an
:class:`EmbeddingResult` (float32 vectors as bytes, so they cross a process or a network compactly, and token
usage); a :class:`RerankRequest` (a query, documents, ``top_n``) gives a :class:`RerankResult` (documents' indexes
with their relevance, best first). :class:`EmbeddingInfo` says what a model can do (dimensions, token limit,
normalisation, its prompts). Their JSON is in :mod:`.wire`.

:class:`Embeds` and :class:`Reranks` are optional capabilities, protocols of their own beside
:class:`~.api.Runtime`: a runtime that has neither stays a Runtime, and :func:`embedder` / :func:`reranker` refuse
it with :class:`~exllama_integrations.errors.UnsupportedTaskError` saying what the model does instead.

Example:
    >>> r = EmbeddingRequest(["a cat", "a dog"], input_type="query")
    >>> len(r.inputs), r.truncate
    (2, False)
    >>> vec = EmbeddingResult.from_vectors([[1.0, 0.0], [0.0, 1.0]], prompt_tokens=4)
    >>> vec.vectors, vec.dimensions
    ([[1.0, 0.0], [0.0, 1.0]], 2)
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import ConfigDict

from ..errors import InvalidSettingsError, UnsupportedTaskError

Task = Literal["generate", "embed", "rerank"]
"""What a model directory is for: text generation, embedding, or scoring (query, document) pairs."""
TASKS: tuple[str, ...] = ("generate", "embed", "rerank")
InputType = Literal["query", "document"]
MAX_INPUTS = 2048
"""Most inputs (or documents) one request may carry, as OpenAI's embeddings endpoint allows."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str, where: str, param: str) -> str:
    """``value`` if it is Unicode text: a lone surrogate (Python lets a str hold one) cannot be encoded to tokenize."""
    if not value.isascii():
        found = _SURROGATE.search(value)
        if found is not None:
            raise InvalidSettingsError(
                f"{where} holds a lone surrogate (U+{ord(found.group()):04X} at character {found.start()}), which is "
                "no character and cannot be tokenized; send valid Unicode text (decode bytes with errors='replace').",
                param=param,
                reason="invalid_text",
            )
    return value


def _inputs(values: Any, what: str) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidSettingsError(f"{what} must be a list of texts or of token-id lists.", param="input")
    if not values:
        raise InvalidSettingsError(f"{what} is empty; send at least one.", param="input")
    if len(values) > MAX_INPUTS:
        raise InvalidSettingsError(f"{what} holds {len(values)} items; at most {MAX_INPUTS} go in one request.")
    out: list[str | tuple[int, ...]] = []
    for i, v in enumerate(values):
        if isinstance(v, str):
            out.append(_text(v, f"{what}[{i}]", "input"))
        elif (
            isinstance(v, Sequence)
            and not isinstance(v, bytes)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)
        ):
            if not v:
                raise InvalidSettingsError(f"{what}[{i}] is an empty list of token ids.", param="input")
            out.append(tuple(v))
        else:
            raise InvalidSettingsError(
                f"{what}[{i}] is {type(v).__name__}; each must be text or a list of token ids.", param="input"
            )
    return tuple(out)


@dataclass(frozen=True)
class EmbeddingRequest:
    """Texts (or token ids) to embed, as one value.

    ``input_type``: ``query`` or ``document``, which picks the model's own prompt for that role where it declares
    one (Qwen3-Embedding's query instruction); ``prompt`` overrides it with your own text, prefixed to each input.
    ``truncate``: an input longer than the model reads keeps its first tokens instead of being refused.
    ``dimensions``: fewer dimensions than the model's (Matryoshka truncation, then renormalised), only where the
    model declares it was trained for it.
    """

    inputs: tuple[str | tuple[int, ...], ...]
    input_type: InputType | None = None
    prompt: str | None = None
    truncate: bool = False
    dimensions: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _inputs(self.inputs, "the input"))
        if isinstance(self.prompt, str):
            _text(self.prompt, "the prompt", "prompt")
        if self.input_type not in (None, "query", "document"):
            raise InvalidSettingsError(
                f"input_type must be 'query' or 'document', not {self.input_type!r}.", param="input_type"
            )
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise InvalidSettingsError(f"dimensions must be a positive integer, not {self.dimensions!r}.", "dimensions")


@dataclass(frozen=True)
class EmbeddingResult:
    """Vectors, in the order of the inputs: float32, little-endian, row after row in ``data``.

    ``prompt_tokens``: the tokens the model read (prompts included, after truncation).
    """

    data: bytes
    count: int
    dimensions: int
    prompt_tokens: int = 0
    model: str = ""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")
    """On the wire the vectors travel as base64 (what OpenAI's ``encoding_format="base64"`` sends too)."""

    def __post_init__(self) -> None:
        if len(self.data) != 4 * self.count * self.dimensions:
            raise InvalidSettingsError(
                f"an embedding result of {self.count} x {self.dimensions} floats needs "
                f"{4 * self.count * self.dimensions} bytes, not {len(self.data)}."
            )

    @classmethod
    def from_vectors(
        cls, vectors: Sequence[Sequence[float]], prompt_tokens: int = 0, model: str = ""
    ) -> EmbeddingResult:
        """A result from plain lists of floats."""
        dims = len(vectors[0]) if vectors else 0
        flat = [float(x) for v in vectors for x in v]
        return cls(struct.pack(f"<{len(flat)}f", *flat), len(vectors), dims, prompt_tokens, model)

    def row(self, i: int) -> bytes:
        """Vector ``i`` as its float32 bytes."""
        size = 4 * self.dimensions
        return self.data[i * size : (i + 1) * size]

    @property
    def vectors(self) -> list[list[float]]:
        """The vectors as lists of floats."""
        flat = struct.unpack(f"<{self.count * self.dimensions}f", self.data)
        d = self.dimensions
        return [list(flat[i * d : (i + 1) * d]) for i in range(self.count)]


@dataclass(frozen=True)
class RerankRequest:
    """A query and the documents to order by their relevance to it.

    ``top_n``: keep only the best n (None: all). ``instruction``: the task a yes/no reranker judges by (its
    default otherwise). ``truncate``: a pair longer than the model reads is cut instead of refused.
    ``max_tokens_per_doc`` (Cohere's): each document is first cut to its first this many tokens.
    """

    query: str
    documents: tuple[str, ...]
    top_n: int | None = None
    truncate: bool = False
    instruction: str | None = None
    max_tokens_per_doc: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.query, str):
            raise InvalidSettingsError("query must be text.", param="query")
        docs = self.documents
        if isinstance(docs, (str, bytes)) or not isinstance(docs, Sequence):
            raise InvalidSettingsError("documents must be a list of texts.", param="documents")
        if len(docs) > MAX_INPUTS:
            raise InvalidSettingsError(f"{len(docs)} documents; at most {MAX_INPUTS} go in one request.", "documents")
        if not all(isinstance(d, str) for d in docs):
            raise InvalidSettingsError("each document must be text.", param="documents")
        _text(self.query, "the query", "query")
        if isinstance(self.instruction, str):
            _text(self.instruction, "the instruction", "instruction")
        for i, d in enumerate(docs):
            _text(d, f"documents[{i}]", "documents")
        object.__setattr__(self, "documents", tuple(docs))
        if self.top_n is not None and (isinstance(self.top_n, bool) or self.top_n < 1):
            raise InvalidSettingsError(f"top_n must be a positive integer, not {self.top_n!r}.", param="top_n")
        n = self.max_tokens_per_doc
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            why = f"max_tokens_per_doc must be a positive integer, not {n!r}."
            raise InvalidSettingsError(why, param="max_tokens_per_doc")


@dataclass(frozen=True)
class RerankHit:
    """One document's place: its index in the request and its relevance (0 to 1 where the model scores so)."""

    index: int
    score: float


@dataclass(frozen=True)
class RerankResult:
    """The documents' indexes, most relevant first (``top_n`` of them), and the tokens read."""

    hits: tuple[RerankHit, ...]
    prompt_tokens: int = 0
    model: str = ""


@dataclass(frozen=True)
class EmbeddingInfo:
    """What an embedding or rerank model does, read from its directory (never guessed)."""

    name: str
    task: Task
    backend: str
    max_tokens: int
    """Longest input (or query + document pair) the model reads; longer ones are refused or truncated."""
    dimensions: int = 0
    """Length of its vectors (0 for a reranker)."""
    normalized: bool = False
    """Whether its vectors have unit length (a ``Normalize`` module), so a dot product is their cosine."""
    pooling: str = ""
    """How token states become one vector (``mean``, ``cls``, ``lasttoken`` ...), or how a reranker scores
    (``classifier``: a sequence-classification head; ``yes_no``: a chat model's yes/no logits)."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Shorter lengths the model was trained to be cut to (``dimensions=``); ``()``: any length; None: none."""
    prompts: Mapping[str, str] = field(default_factory=dict)
    """The model's prompts by role (``query``, ``document``), prefixed to inputs of that ``input_type``."""
    max_batch_size: int = 32
    """Inputs the backend computes together."""

    def check_dimensions(self, dimensions: int | None) -> None:
        """Refuse ``dimensions`` this model was not trained to be cut to.

        Raises:
            UnsupportedTaskError: the model does not embed.
            InvalidSettingsError: more than it has, or fewer where it declares no Matryoshka training.
        """
        if self.task != "embed":
            raise UnsupportedTaskError(f"model {self.name!r} does not embed: it is a {self.task} model.")
        if dimensions is None or dimensions == self.dimensions:
            return
        if dimensions > self.dimensions:
            raise InvalidSettingsError(
                f"dimensions is {dimensions}; {self.name!r} makes vectors of {self.dimensions}.",
                param="dimensions",
                reason="dimensions_not_supported",
            )
        allowed = self.matryoshka_dimensions
        if allowed is None or (allowed and dimensions not in allowed):
            said = f"only {', '.join(map(str, allowed))}" if allowed else "no shorter length"
            raise InvalidSettingsError(
                f"{self.name!r} declares {said} for its {self.dimensions}-dimension vectors (no Matryoshka training "
                f"for {dimensions}); leave dimensions out, or serve a model that declares matryoshka_dimensions.",
                param="dimensions",
                reason="dimensions_not_supported",
            )


@runtime_checkable
class Embeds(Protocol):
    """Optional: a runtime whose model embeds text."""

    def embedding_info(self) -> EmbeddingInfo: ...

    def embed(self, request: EmbeddingRequest) -> EmbeddingResult: ...

    async def aembed(self, request: EmbeddingRequest) -> EmbeddingResult: ...


@runtime_checkable
class Reranks(Protocol):
    """Optional: a runtime whose model scores documents against a query."""

    def embedding_info(self) -> EmbeddingInfo: ...

    def rerank(self, request: RerankRequest) -> RerankResult: ...

    async def arerank(self, request: RerankRequest) -> RerankResult: ...


def _refuse(runtime: Any, wanted: str) -> UnsupportedTaskError:
    info = getattr(runtime, "model_info", None)
    name = info().name if callable(info) else type(runtime).__name__
    facts = getattr(runtime, "embedding_info", None)
    task = facts().task if callable(facts) else "generate"
    what = {"generate": "a text-generation model", "embed": "an embedding model", "rerank": "a reranker"}[task]
    need = "an embedding" if wanted == "embed" else "a rerank"
    return UnsupportedTaskError(
        f"model {name!r} does not {wanted}: it is {what}. Load {need} model for it (its directory's task is found "
        f"from its files, or say task={wanted!r}, model_task= in the framework classes; see docs/embeddings.md)."
    )


def embedder(runtime: Any) -> Embeds:
    """``runtime`` as an embedder.

    Raises:
        UnsupportedTaskError: its model does not embed (a chat model, a reranker).
    """
    if not isinstance(runtime, Embeds) or runtime.embedding_info().task != "embed":
        raise _refuse(runtime, "embed")
    return runtime


def reranker(runtime: Any) -> Reranks:
    """``runtime`` as a reranker.

    Raises:
        UnsupportedTaskError: its model does not rerank (a chat model, an embedding model).
    """
    if not isinstance(runtime, Reranks) or runtime.embedding_info().task != "rerank":
        raise _refuse(runtime, "rerank")
    return runtime


__all__ = [
    "MAX_INPUTS",
    "TASKS",
    "EmbeddingInfo",
    "EmbeddingRequest",
    "EmbeddingResult",
    "Embeds",
    "InputType",
    "RerankHit",
    "RerankRequest",
    "RerankResult",
    "Reranks",
    "Task",
    "embedder",
    "reranker",
]
