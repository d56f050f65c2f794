"""ExLlamaV3 backend (primary): the load chain, the driver it starts, and what it frees on close.

Config -> Model (upstream fixes applied, see :mod:`.patches`) -> Cache -> ``load()`` -> LoRA adapters and a
draft model (:mod:`.extras`) or the checkpoint's MTP heads (:mod:`.mtp`) -> Tokenizer -> Generator. Requests go
to the :class:`~.driver.Driver`'s inbox; ``close()`` stops the driver after the step in flight, then frees the
cache and the weights.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import BackendUnavailableError, InvalidSettingsError, ModelLoadError, UnsupportedModelError
from ...model.directory import ModelDirectory
from ...model.files import peft_adapter
from ..base import Backend, BackendOptions, BackendRequest, cuda_available, fail_all, require, unsupported
from ..inbox import Inbox, WorkerTask
from ..logits import release
from . import patches
from .decisions import score_labels
from .draft_rule import DraftRule
from .driver import Driver
from .extras import inspect_draft, load_draft, load_loras
from .fast import FastDecode
from .mtp import build_mtp, default_draft, load_mtp, mtp_layers
from .mtp_parking import MtpParking
from .options import (
    ExLlamaV3Options,
    auto_cache_tokens,
    cache_kwargs,
    generator_kwargs,
    generator_parameters,
    prefill_chunk,
    show_progress,
    whole_pages,
)
from .translate import DraftCounts, job_for, matcher_filter
from .vision import NO_VISION_COMPONENT, Vision, vision_support

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ...contract.decisions import LabelLogprobs, LabelScoring
    from ...model.tokenizer import NativeTokenizer

logger = logging.getLogger(__name__)


class ExLlamaV3Backend(Backend):
    """exllamav3 on CUDA: EXL3 or fp16/bf16 safetensors, dynamic batching, paged cache."""

    name = "exllamav3"
    Options = ExLlamaV3Options
    unsupported_settings = {
        "typical": "typical sampling is not available on exllamav3; leave typical at 1.0.",
        "no_repeat_ngram_size": "no_repeat_ngram_size is not available on exllamav3; leave it at 0.",
        "prompt_logprobs": "scoring a prompt (prompt_logprobs; the completions API's echo with logprobs) is not "
        "available on exllamav3 yet; run it on backend='transformers'.",
    }

    @classmethod
    def check_available(cls) -> None:
        import importlib.util

        if importlib.util.find_spec("exllamav3") is None:
            require("exllamav3", "exllamav3", "the exllamav3 backend")
        if not cuda_available():
            raise BackendUnavailableError(
                "exllamav3 needs a CUDA GPU, and torch sees none here; use backend='transformers' on CPU."
            )

    @classmethod
    def check_model(cls, model: ModelDirectory) -> None:
        q = model.quantization
        if q not in (None, "exl3"):
            hint = " use backend='exllama' for 4-bit GPTQ Llama models." if q == "gptq" else ""
            raise unsupported(cls.name, model, f"exllamav3 does not load {q}-quantized weights;{hint}")
        hidden = int(model.text_config.get("hidden_size") or 0)
        if q == "exl3" and hidden % 128:
            # Unquantized weights of such a model load (see patches.trim_gated_mlp_padding); EXL3 weights also
            # run exllamav3's fused single-token MLP kernel, whose padded output we have not verified.
            raise unsupported(
                cls.name,
                model,
                f"EXL3 weights with hidden_size {hidden} (not a multiple of 128) are not verified on exllamav3 "
                "1.6.5 (its gated MLP leaves padded outputs); load the model's fp16/bf16 weights with "
                "backend='exllamav3', or use backend='transformers'.",
            )
        from .upstream import get_architectures

        archs = model.architectures
        if not archs or archs[0] not in get_architectures():
            raise unsupported(cls.name, model, f"architecture {archs[:1] or model.model_type!r} is not in exllamav3.")

    def __init__(self, model: ModelDirectory, tokenizer: NativeTokenizer, options: BackendOptions) -> None:
        import torch

        from .upstream import Cache, Config, Generator, Model, Tokenizer

        assert isinstance(options, ExLlamaV3Options)
        adapters = [peft_adapter(d) for d in options.lora_dirs]  # a bad adapter is refused before the weights load
        draft = inspect_draft(options, model)
        if draft is not None:
            self.check_model(draft)
        heads = mtp_layers(options, model)  # draft="mtp" on a checkpoint without heads: refused before any load
        self._model = self._cache = self._generator = self._draft = None
        self._fast: FastDecode | None = None
        self._vision: Vision | None = None
        self._tokenizer = tokenizer
        self._loras: list[Any] = []
        self._unfused = 0
        self._patched: dict[str, int] = {}
        overrides = patches.config_overrides(model.config)
        self._overlay = patches.overlay(model.path, overrides) if overrides else None
        try:
            config = Config.from_directory(self._overlay.name if self._overlay else str(model.path))
            self._model = Model.from_config(config)
            self._patched = {**patches.apply(self._model), **({"config_keys": len(overrides)} if overrides else {})}
            mtp = None
            if heads:
                mtp, fixes = build_mtp(config, model.architectures[0])
                self._draft = (mtp, None)  # unloaded by _free whatever happens from here
                self._patched.update(fixes)
            if self._patched:
                logger.info("exllamav3: upstream fixes applied: %s", self._patched)
            context = min(options.max_seq_len or model.context_length, model.context_length)
            self._sizing: dict[str, Any] = {}
            if options.cache_size == "auto":
                cache_tokens, self._sizing = auto_cache_tokens(model, options, context, draft, heads)
            else:
                cache_tokens = whole_pages(int(options.cache_size))
            chunk = prefill_chunk(options, cache_tokens)  # a prefill chunk must fit the cache
            cache_kw = cache_kwargs(options, default_draft(mtp) if mtp is not None else 4)
            self._cache = Cache(self._model, max_num_tokens=cache_tokens, **cache_kw)
            load_kw: dict[str, Any] = {"progressbar": show_progress(options.progressbar), "max_chunk_size": chunk}
            if options.gpu_split:
                load_kw["use_per_device"] = list(options.gpu_split)
            elif options.device:
                load_kw["device"] = options.device
            self._model.load(**load_kw)
            self._loras, self._unfused = load_loras(self._model, adapters, options.lora_scalings)
            self._warmup: dict[str, Any] = {}
            if options.warmup:  # before the generator attaches to the cache (warmup writes its leading pages)
                t0 = time.perf_counter()
                failed = self._model.warmup(
                    cache=self._cache, max_chunk_size=chunk, max_batch_size=min(8, options.max_batch_size)
                )
                self._warmup = {"warmup_seconds": round(time.perf_counter() - t0, 2)}
                if failed:
                    self._warmup["warmup_failed"] = list(failed)
                    logger.warning("exllamav3: warmup passes that failed (skipped): %s", failed)
            self._xtok = Tokenizer.from_config(config)
            self.vision = vision_support(config, model.model_type) if options.vision else "vision=False"
            if self.vision is None:
                vision_kw = {k: v for k, v in load_kw.items() if k in ("progressbar", "device")}
                self._vision = Vision(config, model.model_type, vision_kw)
            gen_kw = generator_kwargs(options, chunk, generator_parameters(Generator))
            if draft is not None:
                self._draft = load_draft(draft, cache_tokens, cache_kw, load_kw)
            elif mtp is not None:
                self._draft = (mtp, load_mtp(mtp, cache_tokens, cache_kw, load_kw))
            if self._draft is not None:
                gen_kw.update(draft_model=self._draft[0], draft_cache=self._draft[1])
            self._generator = Generator(self._model, self._cache, self._xtok, **gen_kw)
            if options.decode == "fast":
                self._fast = FastDecode(
                    self._generator,
                    prefill=options.prefill == "batched",
                    deterministic=options.deterministic,
                    max_rows=options.max_batch_size,
                    recurrent=options.fast_recurrent,
                )
                if options.deterministic and not self._fast.active:
                    raise InvalidSettingsError(
                        f"deterministic=True needs decode='fast', which stands aside here: {self._fast.why_not}",
                        param="deterministic",
                    )
                if options.warmup and self._fast.active:  # every batch size captured now, not on a client's step
                    t0 = time.perf_counter()
                    captured = self._fast.capture_at_load(show_progress(options.progressbar))
                    self._warmup.update(graphs_captured=captured, capture_seconds=round(time.perf_counter() - t0, 2))
        except (InvalidSettingsError, ModelLoadError, UnsupportedModelError):
            self._free()
            raise
        except (AssertionError, ValueError, KeyError, RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self._free()
            raise ModelLoadError(f"exllamav3 could not load {model.name!r}: {type(e).__name__}: {e}") from e
        self._context = min(context, cache_tokens)
        self._cache_tokens = cache_tokens
        self._batch = options.max_batch_size
        ngram = "n-gram" if options.ngram_match_min else None
        self._speculative = "draft model" if draft is not None else "MTP heads" if heads else ngram
        drafted = int(getattr(self._generator, "num_draft_tokens", 0) or 0)
        self._drafts = DraftCounts(self._speculative, drafted) if self._speculative else None
        measured = options.draft_window == "measured" and drafted > 0 and self._speculative != "n-gram"
        self._draft_rule = DraftRule(drafted) if measured else None
        # MTP heads: parked on the steps the rule drafts nothing on (a draft model keeps its own cache current)
        self._parking = MtpParking(self._generator) if measured and heads and draft is None else None
        self._full_context_jobs = cache_tokens // whole_pages(self._context)
        logger.info(
            "exllamav3: cache of %d tokens (%d jobs of the full %d-token context at once) %s",
            cache_tokens,
            self._full_context_jobs,
            self._context,
            self._sizing,
        )
        self.inbox = Inbox(options.arrival_window, options.burst_window)
        self._freed = threading.Lock()
        self.driver = Driver(
            self._generator,
            self.inbox,
            self._job_for,
            self._filter_for,
            interval=options.stream_interval,
            step_context=torch.inference_mode,
            drafts=self._drafts,
            draft_rule=self._draft_rule,
            parking=self._parking,
        )
        self.driver.start()

    @property
    def context_length(self) -> int:
        return self._context

    @property
    def max_batch_size(self) -> int:
        return self._batch

    def info(self) -> dict[str, Any]:
        return {
            "cache_tokens": self._cache_tokens,
            "max_batch_size": self._batch,
            "jobs_of_1024_tokens": self._cache_tokens // 1024,
            "jobs_of_the_full_context": self._full_context_jobs,
            "lora": [getattr(lora, "name", "") for lora in self._loras],
            **({"lora_fused_paths_off": self._unfused} if self._loras else {}),
            "speculative": self._speculative,
            **({"drafting": self._drafts.report()} if self._drafts is not None else {}),
            **({"cache_sizing": self._sizing} if self._sizing else {}),
            **({"upstream_fixes": self._patched} if self._patched else {}),
            **self._vision_info(),
            **self._warmup,
            **({"decode": self._fast.report()} if self._fast is not None else {}),
        }

    def _vision_info(self) -> dict[str, Any]:
        v = self._vision
        if v is None:
            return {} if self.vision == NO_VISION_COMPONENT else {"vision": self.vision}
        return {"vision": "loaded", "image_cache": {"hits": v.hits, "misses": v.misses}}

    def encode_media(
        self, text: str, images: list[Any], add_special_tokens: bool, keys: Sequence[str]
    ) -> tuple[list[int], Any]:
        """Each placeholder becomes its image's embedding tokens (the tower runs here, on the caller's thread)."""
        if self._vision is None:
            return super().encode_media(text, images, add_special_tokens, keys)
        return self._vision.encode(text, images, list(keys), add_special_tokens, self._tokenizer, self._xtok)

    def _job_for(self, request: BackendRequest) -> tuple[Any, bool]:
        job, deferred = job_for(request, self._xtok, request.embeddings)
        if self._fast is not None:
            self._fast.adopt_request(job, request)
        return job, deferred

    def _filter_for(self, request: BackendRequest) -> Any:
        assert request.constraint is not None
        return matcher_filter(self._xtok, request.constraint)

    def library_objects(self) -> dict[str, Any]:
        """exllamav3's own objects (diagnostics for tests and benchmarks: ``generator``, ``model``, ``cache`` ...)."""
        return {
            "generator": self._generator,
            "model": self._model,
            "cache": self._cache,
            "tokenizer": self._xtok,
            "inbox": self.inbox,
            "driver": self.driver,
            "vision": self._vision,
            "fast_decode": self._fast,
            "drafting": self._drafts,
            "draft_window": self._draft_rule,
            "mtp_parking": self._parking,
        }

    # ------------------------------------------------------------------ requests

    def score_labels(self, job: LabelScoring) -> Future[LabelLogprobs]:
        """Decision labels' log-probabilities, on the driver's thread between steps (:mod:`.decisions`)."""
        generator = self._generator
        task = WorkerTask(lambda: score_labels(generator, job))
        if not self.inbox.put([task]):
            task.emit(None)
        return task.future

    def submit(self, requests: Sequence[BackendRequest]) -> None:
        if not self.inbox.put(requests):
            fail_all(requests)

    def expect(self, n: int) -> None:
        """``n`` requests of one batch are on their way: the idle driver waits for them (see :class:`Inbox`)."""
        self.inbox.expect(n)

    def close(self) -> None:
        driver = getattr(self, "driver", None)
        if driver is not None:
            driver.stop()  # after the iteration in flight: nothing runs on freed memory
        if self._freed.acquire(blocking=False):  # once, whoever closes first
            self._free()

    def _free(self) -> None:
        overlay, self._overlay = getattr(self, "_overlay", None), None
        if overlay is not None:
            overlay.cleanup()
        fast, self._fast = self._fast, None
        if fast is not None:  # its graphs hold GPU memory and the model; freed before the model unloads
            try:
                fast.close()
            except Exception:  # noqa: BLE001 - the model, cache and generator are released all the same
                logger.exception("exllamav3: closing decode='fast' failed")
        generator, model, draft, loras = self._generator, self._model, self._draft, self._loras
        vision, self._vision = getattr(self, "_vision", None), None
        self._generator = self._cache = self._model = self._draft = None
        self._loras = []
        release(
            (generator, "close"),
            *((lora, "unload") for lora in loras),
            (draft[0] if draft else None, "unload"),
            (vision, "close"),
            (model, "unload"),
        )
