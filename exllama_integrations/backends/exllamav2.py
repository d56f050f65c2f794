"""ExLlamaV2 backend, with the fix for its wrong logits on stacks without flash-attn.

Root cause (found reading exllamav2 0.3.2's ``attn.py``, confirmed on the H200 against the oracle):
without flash-attn and xformers, attention falls back to torch SDPA, and that branch picks its mask
with ``if layer_idx in block_diag_layers or causal: mask = get_block_diag_mask()``. For an ordinary
(non-packed) batch ``get_block_diag_mask()`` returns None, so prompt tokens attend to *later* tokens
during prefill: every prompt state is wrong and the first generated token already differs. Its
matmul fallback builds the proper causal mask, so this backend loads with ``config.no_sdpa = True``
unless flash-attn is installed (then flash-attn is used, as upstream intends).

Decoding is a per-token ``model.forward`` with an ``ExLlamaV2Cache``; sampling uses the shared
logits processors so settings mean the same as on the other backends.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailableError, ModelLoadError
from ..model.directory import ModelDirectory
from .base import BackendOptions, cuda_available, require, unsupported
from .exllama import CachedForwardSession
from .logits import LogitsBackend, LogitsSession, release

if TYPE_CHECKING:
    from ..model.tokenizer import NativeTokenizer

logger = logging.getLogger(__name__)

_SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


class ExLlamaV2Backend(LogitsBackend):
    """exllamav2 on CUDA: fp16, GPTQ and EXL2 weights; SDPA fallback replaced by causal matmul attention."""

    unsupported_settings = {
        "prompt_logprobs": "scoring a prompt (prompt_logprobs; the completions API's echo with logprobs) is not "
        "available on exllamav2; run it on backend='transformers'.",
    }

    name = "exllamav2"

    @classmethod
    def check_available(cls) -> None:
        if importlib.util.find_spec("exllamav2") is None:
            require("exllamav2", "exllamav2", "the exllamav2 backend")
        if not cuda_available():
            raise BackendUnavailableError("exllamav2 needs a CUDA GPU, and torch sees none here.")

    @classmethod
    def check_model(cls, model: ModelDirectory) -> None:
        archs = model.architectures
        if not archs or archs[0] not in _SUPPORTED:
            raise unsupported(cls.name, model, f"only {', '.join(sorted(_SUPPORTED))} are verified on exllamav2.")
        if model.quantization not in (None, "gptq", "exl2"):
            raise unsupported(cls.name, model, f"exllamav2 does not load {model.quantization}-quantized weights.")

    def __init__(self, model: ModelDirectory, tokenizer: NativeTokenizer, options: BackendOptions) -> None:
        import torch
        from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
        from exllamav2.attn import has_flash_attn

        self._model = self._cache = None
        try:
            config = ExLlamaV2Config(str(model.path))
            if not has_flash_attn:
                config.no_sdpa = True  # see the module docstring: its SDPA path is not causal
            ctx = options.max_seq_len or min(model.context_length, 4096)
            config.max_seq_len = ctx
            self._model = ExLlamaV2(config)
            self._cache = ExLlamaV2Cache(self._model, max_seq_len=ctx, lazy=True)
            self._model.load_autosplit(self._cache, progress=False)
        except (AssertionError, ValueError, KeyError, RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self._free()
            raise ModelLoadError(f"exllamav2 could not load {model.name!r}: {type(e).__name__}: {e}") from e
        self._context = ctx
        self.attention = "flash-attn" if has_flash_attn else "matmul (no_sdpa)"
        self._start_worker()

    @property
    def context_length(self) -> int:
        return self._context

    def info(self) -> dict[str, Any]:
        return {"attention": self.attention}

    def open_session(self) -> LogitsSession:
        return CachedForwardSession(self._model, self._cache)

    def library_objects(self) -> dict[str, Any]:
        return {**super().library_objects(), "model": self._model, "cache": self._cache}

    def _free(self) -> None:
        model, self._model, self._cache = self._model, None, None
        release((model, "unload"))
