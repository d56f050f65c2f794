"""What a model directory says about embedding and scoring: its task, and how token states become a vector.

Read from the files sentence-transformers writes (``modules.json``, ``1_Pooling/config.json``,
``sentence_bert_config.json``, ``config_sentence_transformers.json``) and ``config.json``, under the rules of
:mod:`.files`. A model with a ``modules.json`` embeds by its pipeline (Transformer, Pooling, Normalize; a module
this package does not compute, such as Dense, is refused by name rather than skipped); a
``*ForSequenceClassification`` model reranks with its head; a causal LM generates, unless told ``task="embed"``
(Qwen3-Embedding style: last-token pooling) or ``task="rerank"`` (Qwen3-Reranker style: the yes/no logits).
No torch here: the backends pool (:mod:`exllama_integrations.backends.pooling`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidModelError, InvalidSettingsError, UnsupportedModelError
from .directory import ModelDirectory
from .files import JSON_LIMIT, contained, parse_json, read_bytes, read_json

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")
"""sentence-transformers' pooling modes, in the order it concatenates them."""
_MODE_KEYS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
_COMPUTED = {"Transformer", "Pooling", "Normalize"}
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""The task a yes/no reranker judges by unless told another (Qwen3-Reranker's default)."""


@dataclass(frozen=True)
class PoolingConfig:
    """How a model embeds or scores, as its files say."""

    task: str
    """``embed``, ``rerank`` or ``generate``."""
    modes: tuple[str, ...] = ()
    """Pooling modes, concatenated in this order (embedding models)."""
    normalize: bool = False
    max_tokens: int = 512
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    matryoshka_dimensions: tuple[int, ...] | None = None
    scoring: str = ""
    """How a reranker scores: ``classifier`` (its head; sigmoid of one logit, else softmax's last class) or
    ``yes_no`` (a causal LM's probability of "yes" against "no" after a judging prompt)."""
    decoder: bool = False
    """A causal (decoder) model: right-padded batches, last-token pooling valid."""

    @property
    def pooling(self) -> str:
        """The pooling (or scoring) named as ModelInfo and EmbeddingInfo say it."""
        return "+".join(self.modes) if self.task == "embed" else self.scoring


def _json(model: ModelDirectory, name: str) -> dict[str, Any]:
    path = contained(model.path, name)
    if not path.exists():
        return {}
    data = read_json(path, name)
    if not isinstance(data, dict):
        raise InvalidModelError(f"{name} must hold a JSON object.")
    return data


def _modules(model: ModelDirectory) -> list[dict[str, Any]] | None:
    path = contained(model.path, "modules.json")
    if not path.exists():
        return None
    data = parse_json(read_bytes(path, "modules.json", JSON_LIMIT), "modules.json", path)
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise InvalidModelError("modules.json must be a list of {idx, name, path, type} objects.")
    return data


def is_decoder(model: ModelDirectory) -> bool:
    """Whether the model is a causal LM (its architecture ends in ``ForCausalLM``, or it is one of those bare)."""
    archs = model.architectures
    return bool(archs) and (archs[0].endswith("ForCausalLM") or model.config.get("is_decoder") is True)


TASK_OF_KIND = {"chat": "generate", "embedding": "embed", "rerank": "rerank"}
"""Each kind of model (the one word for what a directory is: a server's entries, ``EmbeddingRuntime(kind=)``) and the
task its pooling config names."""
KIND_OF_TASK = {task: kind for kind, task in TASK_OF_KIND.items()}
"""The kind of model each task word names (the deprecated ``serve --task``, ``model_task=`` and
``EmbeddingRuntime(task=)`` took these words, vLLM's)."""


def kind_of_old_task(task: str, kind: str | None, where: str, new: str, stacklevel: int = 4) -> str:
    """The kind a deprecated task word names (``embed`` -> ``embedding``, ``rerank``), warned with what to write.

    ``where`` is how the caller wrote it (``"EmbeddingRuntime(task="``), ``new`` the argument to write instead.

    Raises:
        InvalidSettingsError: both the old and the new argument given, or a word that names no embedding or rerank
            model.
    """
    if task not in ("embed", "rerank"):
        raise InvalidSettingsError(
            f"{where}{task!r}): the old word for {new}=, which takes 'embedding' or 'rerank' (a chat model loads with "
            "ExLlamaRuntime).",
            param=new,
        )
    warnings.warn(
        f"{where}{task!r}) is deprecated: write {new}={KIND_OF_TASK[task]!r} (a model's kind is the one word for "
        "what it is, as a server's entries and `serve --kind` say it).",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    if kind is not None:
        old = where.split("(")[-1].rstrip("=")
        raise InvalidSettingsError(f"give {new}= alone ({old}= is its old name).", param=new)
    kind = KIND_OF_TASK[task]
    return kind


def task_of(kind: str | None, task: str | None) -> str | None:
    """The pooling task an ``EmbeddingRuntime`` is asked for: its ``kind``, or the deprecated ``task=`` (warned).

    Raises:
        InvalidSettingsError: both given, or a kind that is not ``"embedding"`` or ``"rerank"``.
    """
    if task is not None:
        kind = kind_of_old_task(task, kind, "EmbeddingRuntime(task=", "kind")
    if kind is None:
        return None
    if kind not in ("embedding", "rerank"):
        raise InvalidSettingsError(
            f"kind={kind!r}: an EmbeddingRuntime loads an 'embedding' or 'rerank' model (a chat model loads with "
            "ExLlamaRuntime).",
            param="kind",
        )
    return TASK_OF_KIND[kind]


def detect_task(model: ModelDirectory) -> str:
    """What the directory is for: ``embed``, ``rerank`` or ``generate``.

    ``embed``: a sentence-transformers pipeline or a bare encoder; ``rerank``: a sequence-classification head.
    """
    archs = model.architectures
    if _modules(model) is not None:
        return "embed"
    if archs and archs[0].endswith("ForSequenceClassification"):
        return "rerank"
    if archs and archs[0].endswith("Model") and not is_decoder(model):
        return "embed"
    return "generate"


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        return tuple(sorted(set(dims)))
    return () if config.get("is_matryoshka") is True else None


def _limit(model: ModelDirectory, given: Any) -> int:
    limits = [model.context_length]
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        limits.append(given)
    tok_max = model.tokenizer_config.get("model_max_length")
    if isinstance(tok_max, int) and 0 < tok_max < 10**9:
        limits.append(tok_max)
    return min(limits)


def read_pooling(model: ModelDirectory, task: str | None = None) -> PoolingConfig:
    """The model's pooling config (``task``: what the caller asked for; None: :func:`detect_task`).

    Raises:
        UnsupportedModelError: a module of its pipeline this package does not compute (Dense, ...), a generation
            model asked to embed without a pooling config that says how, or an encoder asked to rerank by yes/no.
        InvalidModelError: a malformed config file.
        InvalidSettingsError: ``task`` is not embed, rerank or generate.
    """
    found = detect_task(model)
    task = task or found
    if task not in ("embed", "rerank", "generate"):
        raise InvalidSettingsError(f"task must be 'embed', 'rerank' or 'generate', not {task!r}.", param="task")
    decoder = is_decoder(model)
    matryoshka = _matryoshka(model.config)
    if task == "generate":
        return PoolingConfig("generate", decoder=decoder)
    if task == "rerank":
        if found == "rerank":
            return PoolingConfig("rerank", max_tokens=_limit(model, None), scoring="classifier", decoder=decoder)
        if not decoder:
            raise UnsupportedModelError(
                f"{model.name!r} has no sequence-classification head and is no causal LM, so it cannot rerank."
            )
        return PoolingConfig("rerank", max_tokens=_limit(model, None), scoring="yes_no", decoder=True)
    modules = _modules(model)
    st = _json(model, "config_sentence_transformers.json")
    prompts = {k: v for k, v in (st.get("prompts") or {}).items() if isinstance(k, str) and isinstance(v, str)}
    if modules is None:  # a bare encoder (mean, as sentence-transformers defaults) or a decoder told to embed
        bare = ("lasttoken",) if decoder else ("mean",)
        return PoolingConfig("embed", bare, False, _limit(model, None), False, prompts, matryoshka, decoder=decoder)
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in sorted(modules, key=lambda m: m.get("idx", 0))]
    other = [k for k in kinds if k not in _COMPUTED]
    if other or not kinds or kinds[0] != "Transformer":
        raise UnsupportedModelError(
            f"{model.name!r}'s sentence-transformers pipeline is {' -> '.join(kinds)}; this package computes "
            "Transformer -> Pooling -> Normalize only" + (f" (not {', '.join(other)})" if other else "") + "."
        )
    bert = _json(model, "sentence_bert_config.json")
    modes: tuple[str, ...] = ("mean",)
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            folder = str(m.get("path") or "")
            cfg = _json(model, f"{folder}/config.json") if folder else {}
            modes = tuple(mode for mode in POOLING_MODES if cfg.get(_MODE_KEYS[mode]))
            if cfg.get("include_prompt") is False:
                raise UnsupportedModelError(
                    f"{model.name!r} pools without its prompt tokens (include_prompt=false), which is not computed "
                    "here yet."
                )
            if not modes:
                raise InvalidModelError(f"{folder}/config.json names no pooling mode.")
    return PoolingConfig(
        "embed",
        modes,
        "Normalize" in kinds,
        _limit(model, bert.get("max_seq_length")),
        bool(bert.get("do_lower_case")),
        prompts,
        matryoshka,
        decoder=decoder,
    )


__all__ = [
    "DEFAULT_RERANK_INSTRUCTION",
    "KIND_OF_TASK",
    "POOLING_MODES",
    "TASK_OF_KIND",
    "PoolingConfig",
    "detect_task",
    "is_decoder",
    "read_pooling",
    "task_of",
]
