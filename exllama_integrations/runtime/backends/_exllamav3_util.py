"""The exllamav3 backend's parts that need no generator: its options, sampler, a shape fix and result parsing."""

from __future__ import annotations

import math
import sys
from typing import Any

from pydantic import Field, field_validator

from .base import BackendOptions, RawLogprob


class ExLlamaV3Options(BackendOptions):
    """Load options of the exllamav3 backend (TabbyAPI's names where it has one)."""

    cache_size: int | None = Field(default=None, ge=256)
    """Paged-cache tokens shared by all jobs (whole 256-token pages); None: min(context, 8192)."""
    cache_bits: int | tuple[int, int] | None = None
    """Quantized K/V cache: bits for both, or ``(k_bits, v_bits)``, each 2..8; None: fp16."""
    gpu_split: list[float] | None = None
    """GB of weights per GPU, in device order (layer split)."""
    max_batch_size: int = Field(default=64, ge=1, le=1024)
    """Most jobs decoding together."""
    max_chunk_size: int | None = Field(default=None, ge=256)
    """Prefill chunk (tokens); None: min(2048, cache)."""
    prefill_cooldown: int | None = Field(default=None, ge=0)
    """Iterations between prefill passes while other jobs decode; None: exllamav3's default (4)."""
    progressbar: bool | None = None
    """A progress bar while loading; None: when stderr is a terminal or in a notebook."""
    lora_dir: str | None = None
    """Refused on exllamav3 for now (use backend='exllama' for LoRA)."""

    @field_validator("cache_bits")
    @classmethod
    def _bits(cls, v: Any) -> Any:
        pair = v if isinstance(v, tuple) else (v, v)
        if v is not None and not all(isinstance(b, int) and 2 <= b <= 8 for b in pair):
            raise ValueError("cache_bits must be 2..8, or a (k_bits, v_bits) pair of those")
        return v


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
