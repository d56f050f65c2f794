"""How much memory a served model takes: estimated from its files and cache options before it loads, measured after.

The estimate is meant to be an upper bound: the weights (the tensors' element count at the dtype they load in, for
the CPU reference backend; the files' size, for ExLlama's quantized weights), the KV cache for the context it is
given (its ``cache_size`` on exllamav3), an engine process's own memory (Python, torch and the backend's libraries,
``PROCESS_RAM``) and, on a GPU, a workspace for activations (``GPU_WORKSPACE``); times its engine processes. Once
loaded, what its engine processes hold is measured (their resident memory, and the GPU memory their torch reserved)
and counted where it is larger. A model's entry may state its memory instead (``gpu_memory``, ``ram``), and then
that is what counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...backends.base import BackendOptions
    from ...model.directory import ModelDirectory

PROCESS_RAM = 512 * 2**20
"""An engine process before its weights: Python, torch, transformers and the backend (measured on the CPU backend with
a 0.5 MB model: 398 MiB resident)."""
GPU_WORKSPACE = 2**30
"""GPU memory a model needs beside its weights and cache: activations, prefill chunks, the CUDA context."""
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class Footprint:
    """Bytes of GPU memory and of RAM."""

    gpu: int = 0
    ram: int = 0

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.gpu + other.gpu, self.ram + other.ram)

    def __sub__(self, other: Footprint) -> Footprint:
        return Footprint(self.gpu - other.gpu, self.ram - other.ram)

    def larger(self, other: Footprint) -> Footprint:
        """Each of the two, the larger."""
        return Footprint(max(self.gpu, other.gpu), max(self.ram, other.ram))

    def within(self, budget: Footprint) -> bool:
        """Whether this fits ``budget``."""
        return self.gpu <= budget.gpu and self.ram <= budget.ram

    def describe(self) -> str:
        """``"1.2 GiB of GPU memory and 0.5 GiB of RAM"`` (the parts that are not 0)."""
        parts = [f"{gib(self.gpu)} of GPU memory"] if self.gpu else []
        return " and ".join([*parts, f"{gib(self.ram)} of RAM"])

    def as_dict(self) -> dict[str, int]:
        """Plain data (``/v1/models``)."""
        return {"gpu_bytes": self.gpu, "ram_bytes": self.ram}


def gib(n: int) -> str:
    """Bytes in GiB, for messages."""
    return f"{n / 2**30:.2f} GiB"


def kv_bytes_per_token(config: dict[str, Any], bits: Any = None, element_bytes: int = 2) -> float:
    """Bytes one cached token takes: K and V of every layer (``bits`` per element where quantized)."""
    layers = int(config.get("num_hidden_layers") or 1)
    heads = int(config.get("num_attention_heads") or 1)
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or heads) // heads)
    k, v = bits if isinstance(bits, (tuple, list)) else (bits or 8 * element_bytes, bits or 8 * element_bytes)
    return layers * kv * head_dim * (int(k) + int(v)) / 8


def estimate(model: ModelDirectory, backend: str, options: BackendOptions, engines: int = 1) -> Footprint:
    """The memory ``model`` will take on ``backend`` with ``options`` (see the module docstring)."""
    context = min(options.max_seq_len or model.context_length, model.context_length)
    device = str(getattr(options, "device", None) or "")
    if backend == "transformers":
        element = _DTYPE_BYTES.get(str(options.dtype or "float32").replace("torch.", ""), 4)
        params = sum(math.prod(shape) for shape in model.tensor_shapes.values())
        held = int(params * element + kv_bytes_per_token(model.text_config, None, element) * context)
        on_gpu = device.startswith("cuda")
        one = Footprint(held + GPU_WORKSPACE, PROCESS_RAM) if on_gpu else Footprint(0, held + PROCESS_RAM)
    else:  # ExLlama's backends: quantized weights on the GPU, as large as their files
        weights = sum(p.stat().st_size for p in model.weight_files)
        size = getattr(options, "cache_size", None)
        tokens = size if isinstance(size, int) else context
        kv = kv_bytes_per_token(model.text_config, getattr(options, "cache_bits", None)) * tokens
        host = int(getattr(options, "cpu_cache_size", 0) or 0)
        one = Footprint(int(weights + kv) + GPU_WORKSPACE, PROCESS_RAM + host)
    return Footprint(one.gpu * engines, one.ram * engines)


def estimate_weights(model: ModelDirectory, backend: str, options: BackendOptions) -> Footprint:
    """The memory of a model that runs in the server's own process and keeps no cache (an embedding model)."""
    device = str(getattr(options, "device", None) or "")
    if backend == "transformers":
        element = _DTYPE_BYTES.get(str(options.dtype or "float32").replace("torch.", ""), 4)
        held = int(sum(math.prod(shape) for shape in model.tensor_shapes.values()) * element)
    else:
        held, device = sum(p.stat().st_size for p in model.weight_files), "cuda"
    return Footprint(held + GPU_WORKSPACE, 0) if device.startswith("cuda") else Footprint(0, held)


def measure(pids: list[int | None], gpu_bytes: int) -> Footprint:
    """What a loaded model's engine processes hold now: their resident memory, and ``gpu_bytes`` (their torch's)."""
    try:
        import psutil
    except ImportError:
        return Footprint(gpu_bytes, 0)
    ram = 0
    for pid in pids:
        if pid is None:
            continue
        try:
            ram += int(psutil.Process(pid).memory_info().rss)
        except (psutil.Error, OSError):
            continue
    return Footprint(gpu_bytes, ram)


def default_budget() -> Footprint:
    """90% of the GPUs' memory (``nvidia-smi``; 0 without one) and of the memory available now."""
    import shutil
    import subprocess

    gpu = 0
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            gpu = sum(int(float(line)) for line in out.split() if line.strip()) * 2**20
        except (OSError, ValueError, subprocess.SubprocessError):
            gpu = 0
    try:
        import psutil

        ram = int(psutil.virtual_memory().available)
    except ImportError:
        import os

        ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Footprint(int(gpu * 0.9), int(ram * 0.9))


__all__ = ["Footprint", "default_budget", "estimate", "estimate_weights", "measure"]
