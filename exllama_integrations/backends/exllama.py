"""ExLlama v1 backend: 4-bit GPTQ Llama models, the library our first users came from.

v1 is unmaintained and needs shims on today's stack, all kept here:

* its JIT-built ``exllama_ext`` module is not importable by name on recent torch (``from exllama_ext
  import ...`` right after ``load()``): we build/load it ourselves first and register it in
  ``sys.modules``;
* ``ExLlamaConfig`` demands ``pad_token_id``, ``initializer_range``, ``bos_token_id``, ``eos_token_id``:
  we hand it a completed copy of config.json;
* it ignores ``rope_theta`` (hard-coded 10000): we set it from config.json;
* its kernels have shape limits that fail late with "CUDA error: invalid argument" or silently compute
  garbage: models outside them are refused before loading (see :func:`shape_problems`);
* with a LoRA adapter its fused single-token kernels compute wrong logits (decode steps part from a
  merged-weights oracle at the first token while prefill matches, seen on the H200), so LoRA runs on
  its unfused path.

Sampling uses the same logits processors as the CPU reference, so settings mean the same everywhere
(v1's own sampler divides by the temperature, so it cannot be greedy, and folds min_p into top_p).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailableError, InvalidSettingsError, MissingDependencyError, ModelLoadError
from ..model.directory import ModelDirectory
from ..model.files import peft_adapter
from .base import BackendOptions, cuda_available, unsupported
from .logits import LogitsBackend, LogitsSession, release

if TYPE_CHECKING:
    from ..model.tokenizer import NativeTokenizer

logger = logging.getLogger(__name__)

_EXT_SOURCES = [
    "exllama_ext.cpp",
    "cuda_buffers.cu",
    "cuda_func/q4_matrix.cu",
    "cuda_func/q4_matmul.cu",
    "cuda_func/column_remap.cu",
    "cuda_func/rms_norm.cu",
    "cuda_func/rope.cu",
    "cuda_func/half_matmul.cu",
    "cuda_func/q4_attn.cu",
    "cuda_func/q4_mlp.cu",
    "cpu_func/rep_penalty.cpp",
]
_ext_lock = threading.Lock()


def _load_extension() -> None:
    """Build (first time) or load v1's extension and make ``import exllama_ext`` work."""
    with _ext_lock:
        if "exllama_ext" in sys.modules:
            return
        spec = importlib.util.find_spec("exllama")
        if spec is None or not spec.submodule_search_locations:
            raise MissingDependencyError("exllama", "exllama", "the ExLlama v1 backend")
        lib = Path(next(iter(spec.submodule_search_locations)))
        src = lib / "exllama_ext"
        if not (src / "exllama_ext.cpp").exists():
            raise BackendUnavailableError(
                f"the exllama package at {lib} has no exllama_ext sources; reinstall it with "
                "`pip install --no-deps exllama==0.1.0`."
            )
        from torch.utils.cpp_extension import load

        logger.info("building/loading exllama_ext (first build takes about a minute)")
        try:
            module = load(
                name="exllama_ext",
                sources=[str(src / s) for s in _EXT_SOURCES],
                extra_include_paths=[str(src)],
                extra_cuda_cflags=["-lineinfo"],
                extra_cflags=["-O3"],
                verbose=False,
            )
        except (RuntimeError, OSError) as e:
            raise BackendUnavailableError(
                f"ExLlama v1's CUDA extension failed to build: {e}. It needs nvcc matching torch's CUDA "
                "and a C++ compiler; set TORCH_CUDA_ARCH_LIST to your GPU (e.g. 9.0) to build faster."
            ) from None
        sys.modules["exllama_ext"] = module


def shape_problems(config: dict[str, Any], model: ModelDirectory | None = None) -> list[str]:
    """Why v1's kernels cannot run a model of this shape (empty when they can).

    Found by reading the kernels: the rotary kernel launches ``head_dim // 128`` blocks of half2
    pairs (0 blocks, "invalid argument", for head_dim 64; missed columns for other non-multiples);
    the K/V cache update writes 4 heads per thread without a bounds check; the 4-bit matmul reads
    whole 32-column words and groups of 8 rows.
    """
    out = []
    hidden = int(config.get("hidden_size", 0))
    heads = int(config.get("num_attention_heads", 0) or 1)
    kv = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    if head_dim * heads != hidden:
        out.append(f"head_dim {head_dim} x {heads} heads != hidden_size {hidden}")
    if head_dim % 128:
        out.append(f"head_dim must be a multiple of 128 (the rotary kernel), it is {head_dim}")
    if kv % 4:
        out.append(f"num_key_value_heads must be a multiple of 4 (the cache kernel), it is {kv}")
    inter = int(config.get("intermediate_size", 0))
    for name, v in (("hidden_size", hidden), ("intermediate_size", inter)):
        if v % 32:
            out.append(f"{name} must be a multiple of 32, it is {v}")
    rs = config.get("rope_scaling")
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) not in (None, "linear", "default"):
        out.append(f"rope_scaling {rs.get('rope_type', rs.get('type'))!r} is not implemented in v1")
    if config.get("attention_bias") or config.get("mlp_bias"):
        out.append("attention/MLP biases are not supported")
    if model is not None:
        if len(model.weight_files) != 1:
            out.append(f"v1 reads one .safetensors file, this model has {len(model.weight_files)}")
        elif "lm_head.weight" not in model.tensor_names:
            out.append("lm_head.weight is missing (tied embeddings are not supported by v1)")
    return out


class ExLlamaV1Options(BackendOptions):
    """Load options of the ExLlama v1 backend."""

    gpu_split: list[float] | None = None
    """GB of weights per GPU, in device order."""
    lora_dir: str | None = None
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)."""


class ExLlamaV1Backend(LogitsBackend):
    """exllama 0.1.0 (v1) on CUDA: 4-bit GPTQ Llama, one request at a time, optional LoRA."""

    unsupported_settings = {
        "prompt_logprobs": "scoring a prompt (prompt_logprobs; the completions API's echo with logprobs) is not "
        "available on exllama; run it on backend='transformers'.",
    }

    name = "exllama"
    Options = ExLlamaV1Options

    @classmethod
    def check_available(cls) -> None:
        if importlib.util.find_spec("exllama") is None:
            raise MissingDependencyError("exllama", "exllama", "the ExLlama v1 backend (pip install --no-deps exllama)")
        if importlib.util.find_spec("transformers") is None:
            raise MissingDependencyError("transformers", "exllama", "sampling on the ExLlama v1 backend")
        if not cuda_available():
            raise BackendUnavailableError("ExLlama v1 needs a CUDA GPU, and torch sees none here.")
        try:
            import safetensors

            major, minor = (int(x) for x in safetensors.__version__.split(".")[:2])
        except (ImportError, ValueError):
            return
        if (major, minor) < (0, 3):
            raise BackendUnavailableError("safetensors is too old for ExLlama v1; pip install 'safetensors>=0.4'.")

    @classmethod
    def check_model(cls, model: ModelDirectory) -> None:
        if model.model_type != "llama":
            raise unsupported(cls.name, model, f"v1 runs Llama models only, this is {model.model_type!r}.")
        q = model.config.get("quantization_config") or {}
        if model.quantization != "gptq":
            raise unsupported(cls.name, model, "v1 runs 4-bit GPTQ weights only (no quantization_config gptq).")
        bits = q.get("bits", 4)
        if bits != 4:
            raise unsupported(cls.name, model, f"v1 runs 4-bit GPTQ only, this is {bits}-bit.")
        problems = shape_problems(model.config, model)
        if problems:
            raise unsupported(cls.name, model, "; ".join(problems) + ".")

    def __init__(self, model: ModelDirectory, tokenizer: NativeTokenizer, options: BackendOptions) -> None:
        import torch

        assert isinstance(options, ExLlamaV1Options)
        _load_extension()
        from exllama.model import ExLlama, ExLlamaCache, ExLlamaConfig

        self._model = self._cache = self._lora = None
        cfg = dict(model.config)
        # Keys ExLlamaConfig reads unconditionally but many config.json files lack.
        cfg.setdefault("pad_token_id", 0)
        cfg.setdefault("initializer_range", 0.02)
        cfg.setdefault("bos_token_id", tokenizer.bos_token_id or 1)
        cfg.setdefault("eos_token_id", (tokenizer.eos_token_ids or [2])[0])
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(cfg, f)
            cfg_path = f.name
        try:
            xcfg = ExLlamaConfig(cfg_path)
        finally:
            os.unlink(cfg_path)
        xcfg.model_path = str(model.weight_files[0])
        xcfg.rotary_embedding_base = float(cfg.get("rope_theta", 10000.0))
        rs = cfg.get("rope_scaling")
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "linear":
            xcfg.compress_pos_emb = float(rs.get("factor", 1.0))
        ctx = options.max_seq_len or min(model.context_length, 4096)
        xcfg.max_seq_len = ctx
        xcfg.max_input_len = min(ctx, 2048)
        xcfg.max_attention_size = xcfg.max_input_len**2
        if options.gpu_split:
            xcfg.set_auto_map(",".join(str(x) for x in options.gpu_split))
        if options.lora_dir:
            # v1's fused single-token kernels apply LoRA wrongly (decode steps part from a merged-weights
            # oracle at the first token while prefill matches); its unfused path is correct.
            xcfg.fused_attn = False
            xcfg.fused_mlp_thd = 0
        try:
            self._model = ExLlama(xcfg)
            self._cache = ExLlamaCache(self._model)
            if options.lora_dir:
                from exllama.lora import ExLlamaLora

                _, weights = peft_adapter(options.lora_dir)
                self._lora = ExLlamaLora(self._model, str(weights.with_name("adapter_config.json")), str(weights))
        except (InvalidSettingsError, ModelLoadError):
            self._free()
            raise
        except (KeyError, ValueError, RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self._free()
            raise ModelLoadError(f"ExLlama v1 could not load {model.name!r}: {type(e).__name__}: {e}") from e
        self._context = ctx
        self._start_worker()

    @property
    def context_length(self) -> int:
        return self._context

    def info(self) -> dict[str, Any]:
        return {"lora": self._lora is not None}

    def open_session(self) -> LogitsSession:
        return CachedForwardSession(self._model, self._cache, lora=self._lora)

    def library_objects(self) -> dict[str, Any]:
        return {**super().library_objects(), "model": self._model, "cache": self._cache, "lora": self._lora}

    def _free(self) -> None:
        model, self._model, self._cache, self._lora = self._model, None, None, None
        release((model, "free_unmanaged"))


class CachedForwardSession:
    """The one cache of an ExLlama v1/v2 model: ``model.forward(ids, cache, last_id_only=True)`` per step."""

    def __init__(self, model: Any, cache: Any, **forward_kwargs: Any) -> None:
        self.model, self.cache, self.kw = model, cache, forward_kwargs

    def _forward(self, ids: list[int]) -> Any:
        import torch

        x = torch.tensor([ids], dtype=torch.long)
        return self.model.forward(x, self.cache, last_id_only=True, **self.kw)[:, -1, :]

    def prefill(self, ids: list[int], embeddings: Any = None) -> Any:  # text only: images are refused before
        self.cache.current_seq_len = 0
        return self._forward(ids)

    def step(self, token: int) -> Any:
        return self._forward([token])

    def close(self) -> None:
        pass
