"""A Qwen3-MoE-shaped checkpoint in 4-bit EXL3 for the captured step's MoE proof and speed row (GPU only).

The shape of Qwen3-30B-A3B's layers at a small width (hidden 1024, 6 layers, 32 routed experts of width 256, top-8,
no shared expert; exllamav3 reads it as ``Qwen3MoeForCausalLM``: ``BlockSparseMLP`` with its fused decode kernels up
to 8 rows and the sort path above), random weights from a seed, converted by exllamav3's own converter (the default
mul1 codebook: the sort path's fused kernel holds 256 expert picks, so with top-8 a step of up to 32 rows is captured
and one of 33-64 runs eagerly, said in the report). Built once per machine under ``/tmp/models`` (~15 s to build,
the conversion about a minute on an H100).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from arch_models import ARCHS

from fixture_models import arch_exl3

QWEN3_MOE = dataclasses.replace(
    ARCHS["qwen3_moe"],
    gpu={
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 256,
        "num_experts": 32,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
    },
)
TOP_K = 8


def qwen3_moe_exl3(root: Path = Path("/tmp/models"), seed: int = 11) -> tuple[Path, dict[str, float]]:
    """The EXL3 checkpoint (built and converted once under ``root``), and the seconds each part took this call."""
    return arch_exl3(QWEN3_MOE, root / "qwen3moe-bf16", root / "qwen3moe-exl3", seed)


__all__ = ["QWEN3_MOE", "TOP_K", "qwen3_moe_exl3"]
