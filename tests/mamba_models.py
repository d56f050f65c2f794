"""A Nemotron-H-shaped Mamba-2 hybrid for the captured step's proof and speed row (tests/gpu/test_gpu_fast_mamba.py).

Random weights from a seed, built on the GPU machine by transformers' own ``NemotronHForCausalLM`` (5.17 there has it):
hidden 1024, 16 layers in Nemotron-H's pattern (7 Mamba-2 mixers of 32 heads x 64, state 128 in 8 groups, conv 4; 2
attention layers, 8 heads x 128 over 2 K/V heads, no RoPE; 7 relu2 MLPs of 2816), vocabulary 32000, bf16 as its
checkpoints are. Two fixtures:

* ``nemotron_h_bf16``: the weights as built: no ``BC_Mamba2`` (exllamav3 builds one for EXL3 projections only), so
  exllamav3 runs its Mamba-2 torch path at every row count and the captured step covers every row count;
* ``nemotron_h_exl3``: the same converted to 4-bit EXL3 by exllamav3's own converter: up to 8 rows its own graphed
  ``BC_Mamba2`` runs (left to it), above it the captured step.

Each is built once per machine under ``/tmp/models``. The config's layer names are written as the family's checkpoints
(and exllamav3) spell them (``build_family_fixtures.exllamav3_overlay``), and the weights' keys under ``backbone.``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from arch_families import ARCHS_2026
from arch_models import make_arch

from fixture_models import converted_once

M, A, P = "linear_attention", "full_attention", "mlp"
LAYERS = [M, P, M, P, M, A, P, M, P, M, P, M, A, P, M, P]
"""Nemotron-H's pattern (``M-M-M*-M-M-M*-M-``) in transformers 5's names."""

NEMOTRON_H_GPU = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "layers_block_type": LAYERS,
    "mamba_num_heads": 32,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
}


def _backbone(key: str) -> str:
    return "backbone." + key[len("model.") :] if key.startswith("model.") else key


def _backbone_keys(out: Path) -> int:
    """Save the weights under ``backbone.`` (the family's checkpoints, which exllamav3 reads), where transformers left
    its own ``model.``; how many keys moved."""
    from safetensors.torch import load_file, save_file

    moved = 0
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        if any(k.startswith("model.") for k in tensors):
            moved += sum(1 for k in tensors if k.startswith("model."))
            save_file({_backbone(k): v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if moved and index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {_backbone(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=1))
    return moved


def nemotron_h_bf16(
    root: Path = Path("/tmp/models"), seed: int = 23, device: str = "cuda"
) -> tuple[Path, dict[str, float]]:
    """The Nemotron-H-shaped checkpoint (bf16, built once under ``root`` on ``device``), and the seconds it took."""
    if str(Path(__file__).parent / "gpu") not in sys.path:  # (the families' overlay lives with the GPU tests)
        sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    import build_family_fixtures as families

    out = root / "nemotronh-mamba-bf16"
    took: dict[str, float] = {}
    if not (out / ".complete").exists():
        t0 = time.perf_counter()
        arch = dataclasses.replace(ARCHS_2026["nemotron_h"], gpu=NEMOTRON_H_GPU)
        make_arch(arch, out, size="gpu", seed=seed, device=device)
        config = json.loads((out / "config.json").read_text())
        config.update({k: v for k, (v, _why) in families.exllamav3_overlay("nemotron_h", config).items()})
        (out / "config.json").write_text(json.dumps(config, indent=1))
        took["keys_moved"] = _backbone_keys(out)
        (out / ".complete").write_text("1")
        took["build_s"] = round(time.perf_counter() - t0, 1)
    return out, took


def nemotron_h_exl3(root: Path = Path("/tmp/models"), seed: int = 23) -> tuple[Path, dict[str, float]]:
    """The same, converted to 4-bit EXL3 by exllamav3's own converter (once under ``root``), and the seconds taken."""
    src, took = nemotron_h_bf16(root, seed)
    out = root / "nemotronh-mamba-exl3"
    return converted_once(src, out, took), took


FIXTURES = {"nemotron_h_bf16": nemotron_h_bf16, "nemotron_h_exl3": nemotron_h_exl3}

__all__ = ["FIXTURES", "LAYERS", "NEMOTRON_H_GPU", "nemotron_h_bf16", "nemotron_h_exl3"]
