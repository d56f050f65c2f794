"""Fixes for exllamav3 1.6.5, each applied to a constructed model, each with the reason it exists.

Each one is a workaround for an upstream behaviour seen on the lent H200 and checked there against the
transformers oracle; remove it when the release it names fixes the cause.
"""

from __future__ import annotations

from typing import Any


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


def strip_empty_key_prefix(model: Any) -> int:
    """Work around exllamav3 (1.6.5) on Gemma 3 text models (``Gemma3ForCausalLM``: gemma-3-270m, 1b).

    ``Gemma3TextModel`` builds its modules with ``key_prefix=""``, but ``Gemma3Model`` writes every tensor key
    as ``f"{key_prefix}.model..."``, so the keys start with a dot (``.model.embed_tokens``) and no tensor is
    found ("missing tensor .model.embed_tokens.weight"). ``Ministral3Model``, built the same way, handles the
    empty prefix. Stripping the leading dot gives the keys of the checkpoint (``model.embed_tokens``).
    Returns how many keys were changed.
    """
    n = 0
    for module in model:
        for attr in ("key", "alt_key"):
            key = getattr(module, attr, None)
            if isinstance(key, str) and key.startswith("."):
                setattr(module, attr, key[1:])
                n += 1
    return n


def apply(model: Any) -> dict[str, int]:
    """Every fix that applies to ``model``; how many places each changed (those that changed any)."""
    done = {
        "trim_gated_mlp_padding": trim_gated_mlp_padding(model),
        "strip_empty_key_prefix": strip_empty_key_prefix(model),
    }
    return {k: v for k, v in done.items() if v}
