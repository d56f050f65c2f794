"""Models with sliding-window rings (exllamav3's ``SlidingAttention``) for the captured step's proof and speed row.

Two shapes, random weights from a seed, built on the GPU machine by transformers' own classes (5.17 there has both):

* ``gpt_oss_exl3``: GPT-OSS (``GptOssForCausalLM``: ``arch_models.ARCHS["gpt_oss"]`` at its GPU width: hidden 1024,
  8 layers alternating sliding (window 128) and full attention, attention sinks, 8 experts top-2), converted to 4-bit
  EXL3 by exllamav3's own converter: its rings, its global layers over the paged cache and its MoE layers (EXL3
  experts, top-2: every row count up to 64 within the fused kernel's 256 picks) all in the captured step, and at up to
  8 rows exllamav3's own graphed ring and attention steps in its loop (``bc_swa_step``), which ours replaces.
* ``gemma4_bf16``: Gemma 4 as its checkpoints are (``Gemma4ForConditionalGeneration`` with a tiny vision tower, as
  ``tests/gpu/build_family_fixtures.py`` builds it: exllamav3 has no text-only Gemma 4 architecture), hidden 1024,
  five local layers (window 128) to one global, bf16 weights as loaded: rings beside plain attention, no MoE.

Each is built once per machine under ``/tmp/models``. A ring of window 128 holds 768 tokens (127 + 512 of history,
rounded to pages): a row crosses its end, and its ring moves a page down, at position 768, 1024, ...
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from arch_models import ARCHS

from fixture_models import arch_exl3

RING_TOKENS = 768
"""Tokens in a ring of these fixtures (window 128: ``kv_state_size`` = 127 + 512 rounded up to 256-token pages)."""

GEMMA4_GPU = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "global_head_dim": 256,  # (as Gemma 4's global layers: wider heads than its local ones)
    "max_position_embeddings": 8192,
    "sliding_window": 128,
    "hidden_size_per_layer_input": 0,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}


def gpt_oss_exl3(root: Path = Path("/tmp/models"), seed: int = 13) -> tuple[Path, dict[str, float]]:
    """The GPT-OSS EXL3 checkpoint (built and converted once under ``root``), and the seconds each part took."""
    return arch_exl3(ARCHS["gpt_oss"], root / "gptoss-rings-bf16", root / "gptoss-rings-exl3", seed)


def gemma4_bf16(root: Path = Path("/tmp/models"), seed: int = 17) -> tuple[Path, dict[str, float]]:
    """The Gemma 4 checkpoint (bf16, built once under ``root``), and the seconds it took."""
    import sys

    if str(Path(__file__).parent / "gpu") not in sys.path:  # (the family builder lives with the GPU tests)
        sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    import build_family_fixtures as families
    from arch_families import ARCHS_2026

    out = root / "gemma4-rings-bf16"
    took: dict[str, float] = {}
    if not (out / ".complete").exists():
        t0 = time.perf_counter()
        arch = dataclasses.replace(ARCHS_2026["gemma4"], gpu={**ARCHS_2026["gemma4"].gpu, **GEMMA4_GPU})
        checkpoint_layout = families.gemma4_checkpoint_text_config

        def text_config(text: dict) -> dict:  # a transformers that already saves Google's keys needs no rewrite
            return text if "per_layer_config" not in text and "global_head_dim" in text else checkpoint_layout(text)

        families.gemma4_checkpoint_text_config = text_config
        try:
            families._gemma4_conditional(arch, out, seed)
        finally:
            families.gemma4_checkpoint_text_config = checkpoint_layout
        (out / ".complete").write_text("1")
        took["build_s"] = round(time.perf_counter() - t0, 1)
    return out, took


FIXTURES = {"gpt_oss_exl3": gpt_oss_exl3, "gemma4_bf16": gemma4_bf16}

__all__ = ["FIXTURES", "GEMMA4_GPU", "RING_TOKENS", "gemma4_bf16", "gpt_oss_exl3"]
