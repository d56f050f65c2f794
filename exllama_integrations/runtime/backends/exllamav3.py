"""ExLlamaV3 backend (primary): Config -> Model -> Cache -> Tokenizer -> Generator, streaming through Jobs.

One driver thread owns the generator: it builds and enqueues the jobs of the requests handed to
:meth:`submit` (all of a batch in the same iteration, so they prefill and decode together), runs
``generator.iterate()`` while jobs exist, and sleeps on a condition otherwise (no polling). Jobs are
built on the driver's thread, not the caller's: under load, every Python step a caller takes before
its request is in waits for the GIL that the driver holds, and each wait can cost a switch interval.
A cancelled request's job leaves the batch at the next iteration; ``close()`` stops the driver after
the iteration in flight, then frees the cache and the weights.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import BackendUnavailableError, InvalidSettingsError, ModelLoadError, UnsupportedModelError
from ..files import peft_adapter
from ..model_dir import ModelDirectory
from ._exllamav3_extras import inspect_draft, load_draft, load_loras
from ._exllamav3_util import (
    ExLlamaV3Options,
    Inbox,
    LiveJob,
    auto_cache_tokens,
    cache_kwargs,
    generator_kwargs,
    sampler_for,
    show_progress,
    tokens_of,
    trim_gated_mlp_padding,
    whole_pages,
)
from ._logits import release
from .base import (
    Backend,
    BackendOptions,
    BackendRequest,
    TokenStep,
    cuda_available,
    fail_all,
    require,
    unsupported,
)

if TYPE_CHECKING:
    from ..tokenizer import NativeTokenizer

logger = logging.getLogger(__name__)


class ExLlamaV3Backend(Backend):
    """exllamav3 on CUDA: EXL3 or fp16/bf16 safetensors, dynamic batching, paged cache."""

    name = "exllamav3"
    extra = "exllamav3"
    Options = ExLlamaV3Options
    unsupported_settings = {
        "typical": "typical sampling is not available on exllamav3; leave typical at 1.0.",
        "no_repeat_ngram_size": "no_repeat_ngram_size is not available on exllamav3; leave it at 0.",
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
        hidden = int(model.config.get("hidden_size") or 0)
        if q == "exl3" and hidden % 128:
            # Unquantized weights of such a model load (see trim_gated_mlp_padding); EXL3 weights also run
            # exllamav3's fused single-token MLP kernel, whose padded output we have not verified.
            raise unsupported(
                cls.name,
                model,
                f"EXL3 weights with hidden_size {hidden} (not a multiple of 128) are not verified on exllamav3 "
                "1.6.5 (its gated MLP leaves padded outputs); load the model's fp16/bf16 weights with "
                "backend='exllamav3', or use backend='transformers'.",
            )
        from exllamav3.architecture.architectures import get_architectures

        archs = model.architectures
        if not archs or archs[0] not in get_architectures():
            raise unsupported(cls.name, model, f"architecture {archs[:1] or model.model_type!r} is not in exllamav3.")

    def __init__(self, model: ModelDirectory, tokenizer: NativeTokenizer, options: BackendOptions) -> None:
        import torch
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        assert isinstance(options, ExLlamaV3Options)
        adapters = [peft_adapter(d) for d in options.lora_dirs]  # a bad adapter is refused before the weights load
        draft = inspect_draft(options, model)
        if draft is not None:
            self.check_model(draft)
        self._model = self._cache = self._generator = self._draft = None
        self._loras: list[Any] = []
        self._unfused = 0
        try:
            config = Config.from_directory(str(model.path))
            self._model = Model.from_config(config)
            if trim_gated_mlp_padding(self._model):
                logger.info("exllamav3: trimmed padded gated-MLP outputs (hidden size not a multiple of 128)")
            context = min(options.max_seq_len or model.context_length, model.context_length)
            self._sizing: dict[str, Any] = {}
            if options.cache_size == "auto":
                cache_tokens, self._sizing = auto_cache_tokens(model, options, context, draft)
            else:
                cache_tokens = whole_pages(int(options.cache_size))
            chunk = min(options.max_chunk_size or 2048, cache_tokens)  # a prefill chunk must fit the cache
            cache_kw = cache_kwargs(options)
            self._cache = Cache(self._model, max_num_tokens=cache_tokens, **cache_kw)
            load_kw: dict[str, Any] = {"progressbar": show_progress(options.progressbar), "max_chunk_size": chunk}
            if options.gpu_split:
                load_kw["use_per_device"] = list(options.gpu_split)
            elif options.device:
                load_kw["device"] = options.device
            self._model.load(**load_kw)
            self._loras, self._unfused = load_loras(self._model, adapters, options.lora_scalings)
            self._xtok = Tokenizer.from_config(config)
            gen_kw = generator_kwargs(options, chunk)
            if draft is not None:
                self._draft = load_draft(draft, cache_tokens, cache_kw, load_kw)
                gen_kw.update(draft_model=self._draft[0], draft_cache=self._draft[1])
            self._generator = Generator(self._model, self._cache, self._xtok, **gen_kw)
        except (InvalidSettingsError, ModelLoadError, UnsupportedModelError):
            self._free()
            raise
        except (AssertionError, ValueError, KeyError, RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self._free()
            raise ModelLoadError(f"exllamav3 could not load {model.name!r}: {type(e).__name__}: {e}") from e
        self._context = min(context, cache_tokens)
        self._cache_tokens = cache_tokens
        self._batch = options.max_batch_size
        self._interval = options.stream_interval
        self._speculative = "draft model" if draft is not None else "n-gram" if options.ngram_match_min else None
        self._full_context_jobs = cache_tokens // whole_pages(self._context)
        logger.info(
            "exllamav3: cache of %d tokens (%d jobs of the full %d-token context at once) %s",
            cache_tokens,
            self._full_context_jobs,
            self._context,
            self._sizing,
        )
        self._inbox = Inbox(options.arrival_window)
        self._freed = threading.Lock()
        self._driver = threading.Thread(target=self._drive, name="exllama-exllamav3-driver", daemon=True)
        self._driver.start()

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
            **({"cache_sizing": self._sizing} if self._sizing else {}),
        }

    # ------------------------------------------------------------------ requests

    def _job(self, request: BackendRequest) -> Any:
        import torch
        from exllamav3 import Job

        s = request.settings
        filters = [request.constraint.exllamav3_filter(self._xtok)] if request.constraint is not None else []
        return Job(
            input_ids=torch.tensor([request.prompt_ids], dtype=torch.long),
            max_new_tokens=request.max_new_tokens,
            sampler=sampler_for(s),
            seed=s.seed,
            stop_conditions=sorted(request.stop_token_ids),
            return_top_tokens=s.logprobs or 0,
            return_probs=s.logprobs is not None,
            filters=filters,
            decode_special_tokens=True,
        )

    def submit(self, requests: Sequence[BackendRequest]) -> None:
        if not self._inbox.put(requests):
            fail_all(requests)

    def expect(self, n: int) -> None:
        """``n`` requests of one batch are on their way: the idle driver waits for them (see :class:`Inbox`)."""
        self._inbox.expect(n)

    # ------------------------------------------------------------------ driver thread

    def _drive(self) -> None:
        import torch

        gen: Any = self._generator
        live: dict[int, LiveJob] = {}
        try:
            while True:
                incoming = self._inbox.take(idle=not live)
                if incoming is None:
                    break
                for req in incoming:
                    try:
                        job = self._job(req)
                        gen.enqueue(job)
                        live[id(job)] = LiveJob(job, req)
                    except Exception as e:  # noqa: BLE001 - a bad request fails alone; the driver goes on
                        req.emit(TokenStep(finish="error", error=e))
                for key, entry in list(live.items()):
                    if entry.req.cancel.is_set():
                        gen.cancel(entry.job)
                        del live[key]
                        entry.req.emit(TokenStep(finish="cancelled"))
                if not live:
                    continue
                try:
                    with torch.inference_mode():
                        results = gen.iterate()
                except Exception as e:  # noqa: BLE001 - fail every caller, keep serving
                    logger.exception("exllamav3 iterate() failed")
                    for entry in live.values():
                        gen.cancel(entry.job)
                        entry.req.emit(TokenStep(finish="error", error=e))
                    live.clear()
                    continue
                interval = self._interval if len(live) > 1 else 1
                for r in results:
                    found = live.get(id(r.get("job")))
                    if found is not None and self._deliver(r, found, interval):
                        del live[id(r["job"])]
        except BaseException as e:  # noqa: BLE001 - never leave a reader waiting
            logger.exception("exllamav3 driver stopped")
            fail_all([entry.req for entry in live.values()], e)
            live.clear()
        finally:
            for entry in live.values():
                try:
                    gen.cancel(entry.job)
                except Exception:  # noqa: BLE001 - the generator is going away anyway
                    logger.debug("cancel on close failed", exc_info=True)
                entry.req.emit(TokenStep(finish="cancelled"))
            fail_all(self._inbox.close())

    def _deliver(self, r: dict[str, Any], entry: LiveJob, interval: int) -> bool:
        """Hand one iteration's result to its request (every ``interval`` steps); True when the job has ended."""
        req = entry.req
        if r.get("stage") == "error":
            req.emit(TokenStep(finish="error", error=r.get("error") or RuntimeError("exllamav3 job failed")))
            return True
        if r.get("stage") != "streaming":
            return False  # prefill progress
        tokens, lps = tokens_of(r, req.settings.logprobs)
        entry.hold(tokens, lps)
        if not r.get("eos"):
            if entry.steps >= interval and entry.tokens:
                req.emit(entry.take())
            return False
        reason = r.get("eos_reason")
        if reason == "stop_token":
            # exllamav3 holds the stop token (and any pieces before it) back; pass them on so that the
            # runtime names the finish (eos or stop) and counts it, as on every other backend
            held, held_lps = tokens_of(r.get("held") or {}, req.settings.logprobs)
            entry.hold(held, held_lps, step=False)
            stop = int(r["eos_triggering_token_id"])
            if entry.tokens[-1:] != [stop]:
                entry.hold([stop], None, step=False)
            req.emit(entry.take("stop_token"))
        else:
            req.emit(entry.take("length" if reason == "max_new_tokens" else "end"))
        return True

    def close(self) -> None:
        fail_all(self._inbox.close())  # requests the driver has not taken yet end here, cancelled
        driver = getattr(self, "_driver", None)
        if driver is not None and driver is not threading.current_thread():
            driver.join()  # after the iteration in flight: nothing runs on freed memory
        if self._freed.acquire(blocking=False):  # once, whoever closes first
            self._free()

    def _free(self) -> None:
        generator, model, draft, loras = self._generator, self._model, self._draft, self._loras
        self._generator = self._cache = self._model = self._draft = None
        self._loras = []
        release(
            (generator, "close"),
            *((lora, "unload") for lora in loras),
            (draft[0] if draft else None, "unload"),
            (model, "unload"),
        )
