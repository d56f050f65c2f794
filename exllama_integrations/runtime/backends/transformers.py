"""CPU reference backend: the same model directory through transformers.

Real token-by-token decoding with a KV cache and transformers' own logits processors, one
request at a time. It is how the whole package is tested without a GPU, and the oracle the GPU
backends are checked against (``device="cuda", dtype="float32"``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ...errors import InvalidModelError
from ..model_dir import ModelDirectory
from ._torch_sampling import sample_loop
from .base import Backend, BackendOptions, BackendRequest, TokenStep, require, unsupported

if TYPE_CHECKING:
    import torch

    from ..tokenizer import NativeTokenizer

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


class TransformersBackend(Backend):
    """Hugging Face transformers on CPU (or any torch device), fp32/bf16/fp16 safetensors."""

    name = "transformers"
    extra = "transformers"
    concurrent = False

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

        self._model_dir = model
        self._lock = threading.Lock()
        device = options.device or "cpu"
        dtype_name = _DTYPES.get((options.dtype or "auto").lower())
        if options.dtype not in (None, "auto") and dtype_name is None:
            raise InvalidModelError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {options.dtype!r}")
        if dtype_name is None:
            dtype_name = "float32" if device == "cpu" else "float16"
        self.dtype = getattr(torch, dtype_name)
        major = int(transformers.__version__.split(".")[0])
        dtype_kw = {"dtype": self.dtype} if major >= 5 else {"torch_dtype": self.dtype}
        loaded: Any
        try:
            loaded = AutoModelForCausalLM.from_pretrained(
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
        import inspect

        # transformers renamed `past_key_values` to `cache` (5.2x); pass whichever this version takes.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.device = torch.device(device)
        self._context = min(options.max_seq_len or model.context_length, model.context_length)

    @property
    def context_length(self) -> int:
        return self._context

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "device": str(self.device), "dtype": str(self.dtype).replace("torch.", "")}

    def generate(self, request: BackendRequest) -> Iterator[TokenStep]:
        import torch
        from transformers import DynamicCache

        cache = DynamicCache()

        def forward(ids: list[int]) -> torch.Tensor:
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
            return out.logits[:, -1, :]

        with self._lock, torch.inference_mode():
            yield from sample_loop(request, forward, lambda token: forward([token]))

    def close(self) -> None:
        with self._lock:
            if hasattr(self, "model"):
                del self.model
            import gc

            gc.collect()
