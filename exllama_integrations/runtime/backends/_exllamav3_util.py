"""The exllamav3 backend's parts that need no generator.

Its options, sampler, a shape fix, result parsing, and the driver's inbox.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import BackendOptions, RawLogprob, TokenStep

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..model_dir import ModelDirectory

PAGE = 256


def whole_pages(tokens: int) -> int:
    """``tokens`` rounded up to whole cache pages (one page at least)."""
    return max(PAGE, -(-tokens // PAGE) * PAGE)


RESERVE = 4 * 2**30
"""GPU memory left free for activations, prefill chunks and workspace when sizing the cache."""


def cache_bytes_per_token(config: dict[str, Any], cache_bits: int | tuple[int, int] | None) -> float:
    """Bytes one cached token takes: K and V of every layer (fp16, or the quantized bits)."""
    layers = int(config.get("num_hidden_layers") or 1)
    heads = int(config.get("num_attention_heads") or 1)
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or heads) // heads)
    k, v = cache_bits if isinstance(cache_bits, tuple) else (cache_bits or 16, cache_bits or 16)
    return layers * kv * head_dim * (k + v) / 8


def auto_cache_tokens(
    model: ModelDirectory, options: ExLlamaV3Options, context: int, draft: ModelDirectory | None = None
) -> tuple[int, dict[str, Any]]:
    """The cache size for ``cache_size="auto"``, and how it was chosen (for the log and model info).

    Free memory on the devices the model loads on, times ``cache_memory``, less the weights (their
    size on disk) and a reserve for activations; at most ``max_batch_size`` jobs of the full context.
    A draft model's weights and its cache (as large as the main one) count too.
    """
    import torch

    devices = range(torch.cuda.device_count()) if options.gpu_split else [torch.cuda.current_device()]
    if options.device and not options.gpu_split:
        devices = [torch.device(options.device).index or 0]
    free = sum(torch.cuda.mem_get_info(d)[0] for d in devices)
    models = [model] if draft is None else [model, draft]
    weights = sum(p.stat().st_size for m in models for p in m.weight_files)
    per_token = sum(cache_bytes_per_token(m.config, options.cache_bits) for m in models)
    budget = free * options.cache_memory - weights - RESERVE
    most = options.max_batch_size * context
    tokens = max(PAGE, min(int(budget // per_token), most) // PAGE * PAGE)
    why = {
        "free_gib": round(free / 2**30, 1),
        "weights_gib": round(weights / 2**30, 1),
        "bytes_per_token": int(per_token),
        "limited_by": "memory" if budget // per_token < most else "max_batch_size x context",
    }
    return tokens, why


class ExLlamaV3Options(BackendOptions):
    """Load options of the exllamav3 backend (TabbyAPI's names where it has one)."""

    cache_size: int | Literal["auto"] = "auto"
    """Paged-cache tokens shared by all jobs (whole 256-token pages). ``"auto"``: ``cache_memory`` of the GPU
    memory left after the weights (like vLLM's ``gpu_memory_utilization``), at most what ``max_batch_size``
    jobs of the full context can use."""
    cache_memory: float = Field(default=0.9, gt=0.0, le=0.98)
    """With ``cache_size="auto"``: the fraction of free GPU memory the weights and cache may take."""
    cpu_cache_size: int = Field(default=0, ge=0)
    """Bytes of pinned host memory for pages evicted from the GPU cache (kept for prefix reuse); 0: off."""
    disk_cache_dir: str | None = None
    """A folder for a third, persistent tier of cached pages behind ``cpu_cache_size`` (needs it > 0)."""
    cache_bits: int | tuple[int, int] | None = None
    """Quantized K/V cache: bits for both, or ``(k_bits, v_bits)``, each 2..8; None: fp16."""
    gpu_split: list[float] | None = None
    """GB of weights per GPU, in device order (layer split)."""
    max_batch_size: int = Field(default=64, ge=1, le=1024)
    """Most jobs decoding together."""
    max_chunk_size: int | None = Field(default=None, ge=256)
    """Prefill chunk (tokens); None: min(2048, cache)."""
    prefill_cooldown: int | None = Field(default=0, ge=0)
    """Iterations between prefill passes while other jobs decode. 0 (ours): a caller who arrives while others
    decode starts at the next step; exllamav3's own 4 smooths running streams but, measured with 64 callers
    arriving ms apart on the H200, cost 44% of the throughput and 3.5x the time to first token."""
    progressbar: bool | None = None
    """A progress bar while loading; None: when stderr is a terminal or in a notebook."""
    stream_interval: int = Field(default=1, ge=1, le=64)
    """While other jobs decode too, hand a request its tokens every this many steps (all at once when it
    ends); 1: every step. Larger values wake each caller's thread less often under load."""
    arrival_window: float = Field(default=0.002, ge=0.0, le=0.1)
    """Seconds the idle driver waits for more requests after one arrives (until none came for this long,
    at most 50x), so that a burst of calls (a LangChain ``batch``, ``asyncio.gather``) prefills together."""
    lora_dir: str | list[str] | None = None
    """PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors), applied to every job."""
    lora_scaling: float | list[float] = 1.0
    """Scale of each adapter (on top of its alpha / r): one for all, or one per ``lora_dir``."""
    draft_model_dir: str | None = None
    """A smaller model with the same vocabulary that drafts tokens for speculative decoding."""
    num_draft_tokens: int | None = Field(default=None, ge=1, le=32)
    """Tokens drafted per step with ``draft_model_dir`` or ``ngram_match_min``; None: exllamav3's 4."""
    ngram_match_min: int = Field(default=0, ge=0, le=64)
    """Speculative decoding with no draft model: draft from the job's own context where its last this many
    tokens occurred before (0: off)."""

    @field_validator("cache_size")
    @classmethod
    def _size(cls, v: Any) -> Any:
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 256):
            raise ValueError('cache_size must be "auto" or an int of at least 256 tokens')
        return v

    @model_validator(mode="after")
    def _extras(self) -> ExLlamaV3Options:
        dirs = self.lora_dirs
        if isinstance(self.lora_scaling, list) and len(self.lora_scaling) != len(dirs):
            raise ValueError(f"lora_scaling has {len(self.lora_scaling)} values for {len(dirs)} lora_dir entries")
        if self.draft_model_dir and self.ngram_match_min:
            raise ValueError("draft_model_dir and ngram_match_min are two ways to draft: choose one")
        if self.num_draft_tokens is not None and not (self.draft_model_dir or self.ngram_match_min):
            raise ValueError("num_draft_tokens needs draft_model_dir or ngram_match_min")
        return self

    @property
    def lora_dirs(self) -> list[str]:
        """``lora_dir`` as a list."""
        return [self.lora_dir] if isinstance(self.lora_dir, str) else list(self.lora_dir or [])

    @property
    def lora_scalings(self) -> list[float]:
        """One scale per adapter."""
        s = self.lora_scaling
        return list(s) if isinstance(s, list) else [float(s)] * len(self.lora_dirs)

    @field_validator("cache_bits")
    @classmethod
    def _bits(cls, v: Any) -> Any:
        pair = v if isinstance(v, tuple) else (v, v)
        if v is not None and not all(isinstance(b, int) and 2 <= b <= 8 for b in pair):
            raise ValueError("cache_bits must be 2..8, or a (k_bits, v_bits) pair of those")
        return v


def cache_kwargs(options: ExLlamaV3Options) -> dict[str, Any]:
    """exllamav3 ``Cache`` arguments for ``cache_bits`` (empty: fp16)."""
    if options.cache_bits is None:
        return {}
    from exllamav3.cache import CacheLayer_quant

    k, v = options.cache_bits if isinstance(options.cache_bits, tuple) else (options.cache_bits,) * 2
    return {"layer_type": CacheLayer_quant, "k_bits": k, "v_bits": v}


def generator_kwargs(options: ExLlamaV3Options, chunk: int) -> dict[str, Any]:
    """exllamav3 ``Generator`` arguments from our options (a draft model is added by the caller)."""
    kw: dict[str, Any] = {"max_batch_size": options.max_batch_size, "max_chunk_size": chunk}
    if options.prefill_cooldown is not None:
        kw["prefill_cooldown"] = options.prefill_cooldown
    if options.ngram_match_min:
        kw["ngram_match_min"] = options.ngram_match_min
    if options.num_draft_tokens is not None:
        kw["num_draft_tokens"] = options.num_draft_tokens
    if options.cpu_cache_size:
        kw["cpu_cache_size"] = options.cpu_cache_size
        if options.disk_cache_dir:
            kw["disk_cache_dir"] = options.disk_cache_dir
    return kw


def sampler_for(settings: Any) -> Any:
    """An exllamav3 sampler equivalent to our settings (ComboSampler: penalty, temperature, min_p, top_k, top_p)."""
    from exllamav3 import ComboSampler

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


def show_progress(option: bool | None) -> bool:
    if option is not None:
        return option
    return bool(getattr(sys.stderr, "isatty", lambda: False)()) or "ipykernel" in sys.modules


def tokens_of(r: dict[str, Any], k: int | None) -> tuple[list[int], tuple[RawLogprob, ...] | None]:
    """Token ids of a result (or its ``held`` part), with logprobs when they were asked for."""
    ids = r.get("token_ids")
    tokens = [int(t) for t in ids.flatten().tolist()] if ids is not None else []
    if k is None or r.get("token_probs") is None or not tokens:
        return tokens, None
    probs = r["token_probs"].flatten().tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if k and r.get("top_k_tokens") is not None:
        tt = r["top_k_tokens"].reshape(len(tokens), -1).tolist()
        tp = r["top_k_probs"].reshape(len(tokens), -1).tolist()
        tops = [tuple((int(a), math.log(max(b, 1e-30))) for a, b in zip(ts, ps))[:k] for ts, ps in zip(tt, tp)]
    return tokens, tuple(RawLogprob(t, math.log(max(p, 1e-30)), top) for t, p, top in zip(tokens, probs, tops))


class LiveJob:
    """A job the driver runs, with the tokens it holds back for its reader (see ``stream_interval``)."""

    __slots__ = ("job", "lps", "req", "steps", "tokens")

    def __init__(self, job: Any, req: Any) -> None:
        self.job, self.req = job, req
        self.tokens: list[int] = []
        self.lps: list[Any] | None = None
        self.steps = 0

    def hold(self, tokens: list[int], lps: tuple[Any, ...] | None, step: bool = True) -> None:
        self.tokens += tokens
        if lps is not None:
            self.lps = [*(self.lps or ()), *lps]
        self.steps += step

    def take(self, finish: Any = None) -> TokenStep:
        out = TokenStep(tuple(self.tokens), tuple(self.lps) if self.lps is not None else None, finish)
        self.tokens, self.lps, self.steps = [], None, 0
        return out


EXPECT_AT_MOST = 0.1
"""Seconds the idle driver waits at most for the rest of an announced batch (a member may fail before it arrives)."""


class Inbox:
    """The requests handed to the driver, and when an idle driver takes them (so that a burst prefills together).

    Callers :meth:`put` requests (and :meth:`expect` the rest of a batch); the driver takes them
    (:meth:`take`) between steps. From idle it waits until no request came for ``window`` seconds (at most
    50 windows), and for the rest of an announced batch, at most ``EXPECT_AT_MOST`` after the announcement.
    """

    def __init__(self, window: float) -> None:
        self._window = window
        self._cv = threading.Condition()
        self._items: deque[Any] = deque()
        self._closing = False
        self._arrived = 0.0
        self._expected, self._expected_until = 0, 0.0

    def put(self, requests: Sequence[Any]) -> bool:
        """Hand requests in; False (nothing taken) once closing."""
        with self._cv:
            if self._closing:
                return False
            self._items.extend(requests)
            self._arrived = time.monotonic()
            self._expected = max(0, self._expected - len(requests))
            self._cv.notify()
            return True

    def expect(self, n: int) -> None:
        """``n`` requests of one batch are on their way."""
        with self._cv:
            self._expected += n
            self._expected_until = time.monotonic() + EXPECT_AT_MOST

    def take(self, idle: bool) -> list[Any] | None:
        """The requests handed in since the last take (None once closing); ``idle``: wait for some, a burst's worth."""
        with self._cv:
            while not self._closing and not self._items and idle:
                self._cv.wait()
            announced = self._expected
            if idle and self._window:
                woke = time.monotonic()
                quiet_deadline = woke + 50 * self._window
                while not self._closing:
                    now = time.monotonic()
                    quiet_left = self._arrived + self._window - now
                    if self._expected and now < self._expected_until:
                        timeout = self._expected_until - now  # the rest of an announced batch
                    elif quiet_left > 0 and now < quiet_deadline:
                        timeout = min(quiet_left, quiet_deadline - now)
                    else:
                        break
                    self._cv.wait(timeout)
                if announced:
                    waited = time.monotonic() - woke
                    logger.debug(
                        "exllamav3: %d requests start together after %.1f ms waiting for an announced batch "
                        "(%d of it never came)",
                        len(self._items),
                        1000 * waited,
                        self._expected,
                        extra={"inbox_wait_s": waited, "inbox_missing": self._expected},
                    )
            if self._expected and time.monotonic() >= self._expected_until:
                self._expected = 0  # members that never came (failed before they were handed in)
            if self._closing:
                return None
            incoming = list(self._items)
            self._items.clear()
            return incoming

    def close(self) -> list[Any]:
        """Take no more, wake the driver; the requests still waiting (the caller ends them)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            pending = list(self._items)
            self._items.clear()
            return pending
