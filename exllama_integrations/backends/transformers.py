"""CPU reference backend: the same model directory through transformers.

Real token-by-token decoding with a KV cache per request and transformers' own logits processors,
on the shared logits-level worker (up to 8 requests interleaved a step at a time). It is how the
whole package is tested without a GPU, and the oracle the GPU backends are checked against
(``device="cuda", dtype="float32"``).
"""

from __future__ import annotations

import inspect
import logging
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pydantic import Field

from ..errors import InvalidModelError, InvalidSettingsError, MediaError
from ..model.directory import ModelDirectory
from .base import BackendOptions, RawLogprob, require, unsupported
from .inbox import WorkerTask
from .logits import LogitsBackend, LogitsSession, PromptScore

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from ..contract.decisions import LabelLogprobs, LabelScoring
    from ..model.tokenizer import NativeTokenizer

logger = logging.getLogger(__name__)

PREFILL_CHUNK = 512
"""Prompt tokens one forward reads: a longer prompt is read a chunk at a time (one forward for most prompts), so
its logits, when the prompt is scored, never span the whole prompt, and the driver reports progress between them."""

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


class TransformersOptions(BackendOptions):
    """Load options of the CPU reference backend."""

    num_threads: int | None = Field(default=None, ge=1, le=256)
    """Threads torch computes with on the CPU (process-wide, as torch's setting is). None: one fewer than the
    cores (at most 8), so the caller's threads (readers, an event loop, an HTTP server) keep a core: on a busy
    2-core machine two threads ran the demo at 2.3 tokens/s where one ran it at 10.7."""
    vision: bool = True
    """For a vision-language model: take images (through its processor). False: text only."""
    progressbar: bool | None = None
    """transformers' "Loading weights" bar while loading; None: when stderr is a terminal or in a notebook (the
    rule of every backend's load bar)."""


@contextmanager
def _load_bar(option: bool | None) -> Iterator[None]:
    """The load bar of transformers shown by our rule; its switch is put back as it was after the load."""
    from transformers.utils import logging as hf_logging

    from .exllamav3.options import show_progress

    if show_progress(option) or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def default_threads() -> int:
    """One fewer than the cores, at least one, at most eight."""
    import os

    return max(1, min(8, (os.cpu_count() or 2) - 1))


def resolve_device_options(options: Any) -> Any:
    """Device, dtype and threads, resolved alike by every transformers backend (generation, pooling).

    ``device`` defaults to ``cpu``; ``dtype`` ``auto`` is float32 on the CPU, else float16; on the CPU, the threads.

    Raises:
        InvalidSettingsError: a dtype torch has no name for here.
    """
    device = options.device or "cpu"
    dtype = (options.dtype or "auto").lower()
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "float16"
    elif dtype not in _DTYPES:
        raise InvalidSettingsError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {options.dtype!r}.")
    update: dict[str, Any] = {"device": device, "dtype": _DTYPES[dtype]}
    if device == "cpu" and getattr(options, "num_threads", None) is None:
        update["num_threads"] = default_threads()
    return options.model_copy(update=update)


class TransformersBackend(LogitsBackend):
    """Hugging Face transformers on CPU (or any torch device), fp32/bf16/fp16 safetensors."""

    name = "transformers"
    Options = TransformersOptions
    max_sessions = 8

    @classmethod
    def resolve_options(cls, options: BackendOptions) -> BackendOptions:
        return resolve_device_options(options)

    @classmethod
    def check_available(cls) -> None:
        require("torch", "transformers", "the CPU reference backend")
        require("transformers", "transformers", "the CPU reference backend")

    @classmethod
    def check_model(cls, model: ModelDirectory) -> None:
        q = model.quantization
        if q is not None:
            hint = {"gptq": "backend='exllama' (v1) on a GPU", "exl3": "backend='exllamav3' on a GPU"}.get(
                q, "an ExLlama backend on a GPU"
            )
            raise unsupported(cls.name, model, f"its weights are {q}-quantized; use {hint}.")
        from transformers import CONFIG_MAPPING

        if model.model_type not in CONFIG_MAPPING:
            why = f"transformers does not know model_type {model.model_type!r}"
            if model.config.get("auto_map"):
                why += " (it ships its own code, and trust_remote_code is never enabled)"
            raise unsupported(cls.name, model, why + ".")

    def __init__(self, model: ModelDirectory, tokenizer: NativeTokenizer, options: BackendOptions) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        options = self.resolve_options(options)
        device = options.device or "cpu"
        threads = getattr(options, "num_threads", None)
        if threads is not None and device == "cpu":
            torch.set_num_threads(threads)
            self.threads = threads
        self.dtype = getattr(torch, options.dtype or "float32")
        major = int(transformers.__version__.split(".")[0])
        dtype_kw = {"dtype": self.dtype} if major >= 5 else {"torch_dtype": self.dtype}
        auto: Any = AutoModelForCausalLM
        self.processor: Any = None
        self._vision_language = "vision_config" in model.config
        if self._vision_language:
            from transformers import AutoModelForImageTextToText

            auto = AutoModelForImageTextToText
            self.vision = "its vision component is off (vision=False)"
            if getattr(options, "vision", True):
                self.processor, self.vision = _processor(model)
        loaded: Any
        try:
            with _load_bar(getattr(options, "progressbar", None)):
                loaded = auto.from_pretrained(
                    str(model.path),
                    local_files_only=True,
                    trust_remote_code=False,
                    use_safetensors=True,
                    output_loading_info=True,
                    **dtype_kw,
                )
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise InvalidModelError(f"transformers could not load {model.name!r}: {e}") from None
        self.model: Any = loaded[0]
        info: dict[str, Any] = loaded[1]
        missing = [k for k in info.get("missing_keys", []) if not k.endswith("lm_head.weight")]
        if missing:
            del self.model
            shown = ", ".join(sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
            raise InvalidModelError(
                f"weights are missing from {model.name!r}: {len(missing)} tensors ({shown}); "
                "the safetensors files are incomplete."
            )
        self.model.to(device)
        self.model.eval()
        # transformers renamed `past_key_values` to `cache` (5.2x); pass whichever this version takes.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.device = torch.device(device)
        # mrope models (Qwen-VL) keep the prompt's rope offset on the model between calls: each session keeps its own
        self._rope_holder = next(
            (m for m in (getattr(self.model, "model", None), self.model) if hasattr(m, "rope_deltas")), None
        )
        self._context = min(options.max_seq_len or model.context_length, model.context_length)
        self._start_worker()

    @property
    def context_length(self) -> int:
        return self._context

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", "")}
        if self.device.type == "cpu":
            out["threads"] = torch_threads()
        if self._vision_language:
            out["vision"] = self.vision or "loaded"
        return out

    def encode_media(
        self, text: str, images: list[Any], add_special_tokens: bool, keys: Sequence[str]
    ) -> tuple[list[int], Any]:
        """The model's processor places the images: each placeholder expanded to the image's tokens."""
        if self.processor is None:
            return super().encode_media(text, images, add_special_tokens, keys)
        try:
            enc = self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
        except (ValueError, IndexError) as e:
            raise MediaError(
                f"the prompt does not place its {len(images)} image(s) as the model's processor expects ({e}); "
                "send images inside user messages, so the chat template places them."
            ) from None
        ids = enc["input_ids"][0].tolist()
        extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        return ids, extra

    def open_session(self) -> LogitsSession:
        return _Session(self)

    def score_labels(self, job: LabelScoring) -> Future[LabelLogprobs]:
        """Each branch's labels' log-probabilities (:class:`~..contract.decisions.ScoresLabels`), on the worker.

        The prefix is read once; each question is then one forward over its tokens and every label's, packed as a
        tree on a copy of the prefix's cache (:mod:`.transformers_decisions`). What a question computes depends on
        it alone, so an answer is the same alone and in a burst.
        """
        task = WorkerTask(lambda: _Session(self).score_labels(job))
        if not self.inbox.put([task]):
            task.emit(None)
        return task.future

    def library_objects(self) -> dict[str, Any]:
        return {**super().library_objects(), "model": self.model}

    def _free(self) -> None:
        if hasattr(self, "model"):
            del self.model
        import gc

        gc.collect()


def _processor(model: ModelDirectory) -> tuple[Any, str | None]:
    """A vision-language model's processor (images -> pixels, placeholders -> image tokens), or why not."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(model.path), local_files_only=True, trust_remote_code=False)
    except ImportError as e:
        lib = re.search(r"requires the (\w+) library", str(e))
        if lib:
            name = lib.group(1)
            return None, f"transformers needs {name} to build its processor (pip install {name.lower()})"
        return None, f"transformers could not build its processor ({str(e).strip()[:200]})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"transformers could not build its processor ({type(e).__name__}: {str(e)[:200]})"
    if getattr(processor, "image_processor", None) is None:
        return None, "its processor has no image processor"
    return processor, None


def new_cache(model: Any) -> Any:
    """An empty cache for one request, laid out by the model's config.

    Hybrid models keep a recurrent state beside the attention KV in some layers (Qwen3.5's and Qwen3-Next's Gated
    DeltaNet, Nemotron-H's Mamba-2, Kimi Linear's KDA): a ``DynamicCache`` built without the config has no place for
    it, and their second forward fails (``IndexError``). Given the config, it makes each layer's kind of cache.
    """
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers before the config argument: attention-only models, as before
        return DynamicCache()


def torch_threads() -> int:
    """Threads torch computes with now."""
    import torch

    return int(torch.get_num_threads())


class _Session:
    """One request's KV cache on the loaded model."""

    def __init__(self, backend: TransformersBackend) -> None:
        self.backend = backend
        self.cache: Any = new_cache(backend.model)

    rope_deltas: Any = None

    def _forward(self, ids: list[int], extra: dict[str, Any] | None = None, every: bool = False) -> torch.Tensor:
        import torch

        b = self.backend
        x = torch.tensor([ids], dtype=torch.long, device=b.device)
        holder = b._rope_holder
        if holder is not None:
            holder.rope_deltas = self.rope_deltas
        keep = 0 if every else 1  # every position's logits only to score the prompt
        out = b.model(input_ids=x, use_cache=True, logits_to_keep=keep, **{b._cache_kw: self.cache}, **(extra or {}))
        if holder is not None:
            self.rope_deltas = holder.rope_deltas
        return out.logits[0] if every else out.logits[:, -1, :]

    def _extra(self, embeddings: Any) -> dict[str, Any] | None:
        if not embeddings:
            return None
        b = self.backend
        return {k: v.to(b.device, b.dtype if v.is_floating_point() else v.dtype) for k, v in embeddings.items()}

    def prefill(self, ids: list[int], embeddings: Any = None) -> torch.Tensor:
        return self._prefill(ids, embeddings, None)

    def prefill_scored(self, ids: list[int], embeddings: Any, k: int) -> tuple[torch.Tensor, tuple[RawLogprob, ...]]:
        """The prefill, and every prompt token's logprob given the ones before it (``prompt_logprobs``)."""
        score = PromptScore(ids, k)
        last = self._prefill(ids, embeddings, score)
        return last, score.result()

    def _prefill(self, ids: list[int], embeddings: Any, score: PromptScore | None) -> torch.Tensor:
        """The prompt read ``PREFILL_CHUNK`` tokens at a time (whole where it has images), the last logits [1, vocab].

        Between chunks the backend's :attr:`~.base.Backend.progress` is set, so a watchdog sees a long prefill at
        work; a scored prompt's logits are reduced chunk by chunk (:class:`~.logits.PromptScore`).
        """
        if embeddings or len(ids) <= PREFILL_CHUNK:
            if score is None:
                return self._forward(ids, self._extra(embeddings))
            every = self._forward(ids, self._extra(embeddings), every=True)
            score.add(every, 0)
            return every[-1:]
        for start in range(0, len(ids), PREFILL_CHUNK):
            piece = ids[start : start + PREFILL_CHUNK]
            if score is None:
                logits = self._forward(piece)
            else:
                every = self._forward(piece, every=True)
                score.add(every, start)
                logits = every[-1:].clone()  # not a view: the chunk's logits go before the next chunk's come
                del every
            self.backend.progress = time.monotonic()
        return logits

    def step(self, token: int) -> torch.Tensor:
        return self._forward([token])

    def score_labels(self, job: LabelScoring) -> LabelLogprobs:
        """See :meth:`TransformersBackend.score_labels` (runs on the worker; this session is used once)."""
        from .transformers_decisions import score_labels

        try:
            return score_labels(self, job, PREFILL_CHUNK)
        finally:
            self.close()

    def close(self) -> None:
        self.cache = None
