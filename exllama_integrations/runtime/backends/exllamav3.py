"""ExLlamaV3 backend (primary): Config -> Model -> Cache -> Tokenizer -> Generator, streaming through Jobs.

All calls into the generator happen on one driver thread, which runs ``generator.iterate()``
while jobs exist. Each request is one ``Job``: concurrent callers share the dynamic batch, a
caller that stops reading has its job cancelled at the next step, and ``close()`` frees the cache
and the weights.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ...errors import BackendUnavailableError, InvalidSettingsError, ModelLoadError
from ..model_dir import ModelDirectory
from ._torch_sampling import release
from .base import Backend, BackendOptions, BackendRequest, TokenLogprob, TokenStep, cuda_available, require, unsupported

if TYPE_CHECKING:
    from ..tokenizer import NativeTokenizer

logger = logging.getLogger(__name__)

_DONE = object()


def sampler_for(settings: Any) -> Any:
    """An exllamav3 sampler equivalent to our settings (ComboSampler: penalty, temperature, min_p, top_k, top_p)."""
    from exllamav3 import ComboSampler

    if settings.typical < 1.0:
        raise InvalidSettingsError("typical sampling is not available on exllamav3; leave typical at 1.0.")
    if settings.no_repeat_ngram_size:
        raise InvalidSettingsError("no_repeat_ngram_size is not available on exllamav3; leave it at 0.")
    return ComboSampler(
        rep_p=settings.repetition_penalty,
        temperature=0.0 if settings.greedy else settings.temperature,
        min_p=settings.min_p,
        top_k=settings.top_k,
        top_p=settings.top_p,
    )


def trim_gated_mlp_padding(model: Any) -> int:
    """Work around exllamav3 (1.6.5) on hidden sizes that are not a multiple of 128 (e.g. SmolLM2's 576).

    exllamav3 pads every linear layer's features to a multiple of 128. Its attention projections and
    its plain MLP trim the padded output back before the residual add; its gated MLP (Llama, Mistral,
    Qwen, ...) does not, so the first forward fails with "The size of tensor a (576) must match the
    size of tensor b (640)". The padded columns of unquantized weights are zeros, so trimming them, as
    the other residual projections do, is exact (checked against the transformers oracle on the GPU).
    Returns how many projections were changed.
    """
    from exllamav3.modules.mlp import GatedMLP

    n = 0
    for module in model:
        if isinstance(module, GatedMLP):
            for down in module.downs:
                if down.out_features != down.out_features_unpadded and not down.trim_padded_out:
                    down.trim_padded_out = True
                    n += 1
    return n


class ExLlamaV3Backend(Backend):
    """exllamav3 on CUDA: EXL3 or fp16/bf16 safetensors, dynamic batching, paged cache."""

    name = "exllamav3"
    extra = "exllamav3"
    concurrent = True

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
        known = get_architectures()
        if not archs or archs[0] not in known:
            raise unsupported(cls.name, model, f"architecture {archs[:1] or model.model_type!r} is not in exllamav3.")

    def __init__(self, model: ModelDirectory, tokenizer: NativeTokenizer, options: BackendOptions) -> None:
        import torch
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        if options.get("lora_dir"):
            raise InvalidSettingsError("exllamav3 has no LoRA adapter support; merge the adapter into the weights.")
        self._tokenizer = tokenizer
        self._closed = False
        self._model = self._cache = self._generator = None
        try:
            config = Config.from_directory(str(model.path))
            self._model = Model.from_config(config)
            if trim_gated_mlp_padding(self._model):
                logger.info("exllamav3: trimmed padded gated-MLP outputs (hidden size not a multiple of 128)")
            cache_tokens = options.max_seq_len or min(model.context_length, int(options.get("cache_size", 8192)))
            cache_tokens = max(256, (cache_tokens + 255) // 256 * 256)  # whole pages
            chunk_tokens = min(2048, cache_tokens)  # a prefill chunk (and load's own test pass) must fit the cache
            cache_kw: dict[str, Any] = {}
            bits = options.get("cache_bits")
            if bits:  # quantized K/V cache, 2..8 bits
                from exllamav3.cache import CacheLayer_quant

                cache_kw = {"layer_type": CacheLayer_quant, "k_bits": int(bits), "v_bits": int(bits)}
            self._cache = Cache(self._model, max_num_tokens=cache_tokens, **cache_kw)
            load_kw: dict[str, Any] = {
                "progressbar": bool(options.get("progressbar", False)),
                "max_chunk_size": chunk_tokens,
            }
            if options.get("gpu_split"):
                load_kw["use_per_device"] = list(options.get("gpu_split"))
            elif options.device:
                load_kw["device"] = options.device
            self._model.load(**load_kw)
            self._xtok = Tokenizer.from_config(config)
            self._generator = Generator(
                self._model,
                self._cache,
                self._xtok,
                max_batch_size=int(options.get("max_batch_size", 64)),
                max_chunk_size=chunk_tokens,
            )
        except (InvalidSettingsError, ModelLoadError):
            self._free()
            raise
        except (AssertionError, ValueError, KeyError, RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self._free()
            raise ModelLoadError(f"exllamav3 could not load {model.name!r}: {type(e).__name__}: {e}") from e
        self._context = cache_tokens
        self._inbox: queue.SimpleQueue[tuple[Any, queue.SimpleQueue[Any], BackendRequest]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._driver = threading.Thread(target=self._drive, name="exllamav3-driver", daemon=True)
        self._driver.start()

    @property
    def context_length(self) -> int:
        return self._context

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "cache_tokens": self._context}

    # ------------------------------------------------------------------ driver thread

    def _drive(self) -> None:
        import torch

        gen: Any = self._generator
        live: dict[int, tuple[Any, queue.SimpleQueue[Any], BackendRequest]] = {}
        while not self._closed:
            while True:
                try:
                    job, out, req = self._inbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    gen.enqueue(job)
                    live[id(job)] = (job, out, req)
                except Exception as e:  # noqa: BLE001 - a bad job must not stop the driver
                    out.put(e)
            for key, (job, out, req) in list(live.items()):
                if req.cancel.is_set():
                    gen.cancel(job)
                    del live[key]
                    out.put(_DONE)
            if not live:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():
                    results = gen.iterate()
            except Exception as e:  # noqa: BLE001 - fail every caller, keep serving
                logger.exception("exllamav3 iterate() failed")
                for job, out, _ in live.values():
                    gen.cancel(job)
                    out.put(e)
                live.clear()
                continue
            for r in results:
                entry = live.get(id(r.get("job")))
                if entry is None:
                    continue
                _, out, req = entry
                if r.get("stage") == "error":
                    out.put(r.get("error") or RuntimeError("exllamav3 job failed"))
                    del live[id(r["job"])]
                    continue
                ids = r.get("token_ids")
                tokens = [int(t) for t in ids.flatten().tolist()] if ids is not None else []
                if tokens:
                    out.put(TokenStep(tokens, self._logprobs(r, tokens, req)))
                stop = r.get("eos_triggering_token_id") if r.get("eos_reason") == "stop_token" else None
                if stop is not None and tokens[-1:] != [int(stop)]:
                    # exllamav3 does not emit the stop token; pass it on so that the runtime names the
                    # finish (eos or stop) and counts it, as every other backend does
                    out.put(TokenStep([int(stop)], None))
                if r.get("eos"):
                    out.put(_DONE)
                    del live[id(r["job"])]
        for _, out, _ in live.values():
            out.put(_DONE)

    @staticmethod
    def _logprobs(r: dict[str, Any], tokens: list[int], req: BackendRequest) -> list[TokenLogprob] | None:
        k = req.settings.logprobs
        if k is None or r.get("token_probs") is None:
            return None
        import math

        probs = r["token_probs"].flatten().tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
        if k and r.get("top_k_tokens") is not None:
            tt = r["top_k_tokens"].reshape(len(tokens), -1).tolist()
            tp = r["top_k_probs"].reshape(len(tokens), -1).tolist()
            tops = [tuple((int(a), math.log(max(b, 1e-30))) for a, b in zip(ts, ps))[:k] for ts, ps in zip(tt, tp)]
        return [TokenLogprob(t, math.log(max(p, 1e-30)), top) for t, p, top in zip(tokens, probs, tops)]

    # ------------------------------------------------------------------ requests

    def generate(self, request: BackendRequest) -> Iterator[TokenStep]:
        import torch
        from exllamav3 import Job

        if self._closed:
            return
        s = request.settings
        filters = []
        if request.constraint is not None:
            filters = [request.constraint.exllamav3_filter(self._xtok)]
        job = Job(
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
        out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inbox.put((job, out, request))
        self._wake.set()
        finished = False
        try:
            while True:
                item = out.get()
                if item is _DONE:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if request.constraint is not None:
                    for t in item.token_ids:
                        request.constraint.accept(t)
                yield item
        finally:
            if not finished:  # the caller stopped reading: the driver cancels the job at its next step
                request.cancel.set()
                self._wake.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if getattr(self, "_driver", None) is not None:
            self._driver.join(timeout=30)
        self._free()

    def _free(self) -> None:
        generator, model = self._generator, self._model
        self._generator = self._cache = self._model = None
        release((generator, "close"), (model, "unload"))
