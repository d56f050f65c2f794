"""Fixes for exllamav3 1.6.5, each applied to a constructed model, each with the reason it exists.

Each one is a workaround for an upstream behaviour seen on the lent H200 and checked there against the
transformers oracle; remove it when the release it names fixes the cause.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
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
    found ("Required tensor .model.layers.0.input_layernorm.weight not found"). ``Ministral3Model``, built the
    same way, handles the empty prefix. Every key a module holds (its ``key``, ``alt_key``, and keys derived
    from them at construction, such as a norm's ``tensor_key``) loses the leading dot, which gives the
    checkpoint's own keys (``model.embed_tokens``). Returns how many keys were changed.
    """
    n = 0
    for module in model:
        for attr, value in list(vars(module).items()):
            if isinstance(value, str) and _DOTTED.match(value):
                setattr(module, attr, value[1:])
                n += 1
    return n


_DOTTED = re.compile(r"^\.(model\.|lm_head\b)")

RENAMED_CONFIG_KEYS = {
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "qwen2_moe": {"num_experts": "num_local_experts"},
}
"""Config keys exllamav3 (1.6.5) reads by the name real checkpoints use, where transformers 5 writes another.

transformers 5's ``Qwen3MoeConfig`` maps ``num_experts`` to ``num_local_experts`` and saves the latter, so a
directory written by ``save_pretrained`` fails in exllamav3 with "Missing any of the following keys:
['num_experts']". The value is the same; exllamav3 is handed a copy of config.json with its name added."""


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Keys to add to config.json for exllamav3 (see ``RENAMED_CONFIG_KEYS``); empty when none are needed."""
    renamed = RENAMED_CONFIG_KEYS.get(str(config.get("model_type")), {})
    return {want: config[have] for want, have in renamed.items() if want not in config and have in config}


def overlay(directory: Path, overrides: dict[str, Any]) -> tempfile.TemporaryDirectory[str]:
    """A folder that is ``directory`` (its files linked) with ``overrides`` added to its config.json."""
    import json

    folder = tempfile.TemporaryDirectory(prefix="exllamav3-config-")
    for f in directory.iterdir():
        if f.name != "config.json":
            os.symlink(f, Path(folder.name) / f.name)
    config = json.loads((directory / "config.json").read_text())
    (Path(folder.name) / "config.json").write_text(json.dumps({**config, **overrides}))
    return folder


def gemma3_image_attention(model: Any) -> int:
    """Work around exllamav3 (1.6.5) on Gemma 3 with images: its tokens of one image attend to each other.

    Gemma 3 reads an image's tokens with bidirectional attention among themselves (transformers builds that
    mask from ``token_type_ids``; Google's reference does the same), the text causally. exllamav3 1.6.5 does
    this for Gemma 4 (``non_causal_spans`` from its ``prepare_inputs``) but reads Gemma 3's images causally:
    on the H200 the prefill logits parted from the transformers oracle by 0.54 (tolerance 0.032). This gives
    Gemma 3's text model Gemma 4's span preparation (image spans are the ids past ``FIRST_MM_EMBEDDING_INDEX``;
    text-only prompts have none, so nothing changes for them). Returns 1 when applied.
    """
    try:
        from exllamav3.architecture.gemma3 import Gemma3Model
        from exllamav3.architecture.gemma4 import _prepare_noncausal_mm_spans
    except ImportError:
        return 0
    if not isinstance(model, Gemma3Model) or getattr(model, "_image_spans_patched", False):
        return 0
    plain = model.prepare_inputs

    def prepare_inputs(input_ids: Any, params: dict[str, Any]) -> Any:
        _prepare_noncausal_mm_spans(input_ids, params)
        return plain(input_ids, params)

    model.prepare_inputs = prepare_inputs
    model._image_spans_patched = True
    return 1


def qwen3_5_text_mtp(config: Any) -> int:
    """Work around exllamav3 (1.6.5) on text-only Qwen3.5/3.6 checkpoints (``Qwen3_5ForCausalLM``, ``...MoeFor...``).

    Their configs read ``mtp_num_hidden_layers`` but register no ``mtp`` component (only the ``...ForConditional
    Generation`` configs pass one), so ``Model.from_config(config, component="mtp")`` has nothing to build and MTP
    drafting is not offered, though the checkpoint carries the head (``mtp.*``, the same keys in both layouts). This
    registers exllamav3's own ``Qwen3_5MTPModel`` / ``Qwen3_5MoeMTPModel`` for them. Checked on the CPU against
    exllamav3 1.6.5's classes (tests/gpu/preflight_exllamav3.py): the MTP model it then builds reads every ``mtp.*``
    tensor of the fixture and no module lacks one; not yet run on the GPU. Returns 1 when registered.
    """
    try:
        from exllamav3.architecture.qwen3_5 import Qwen3_5Config, Qwen3_5MoeConfig
        from exllamav3.architecture.qwen3_5_mtp import Qwen3_5MoeMTPModel, Qwen3_5MTPModel
    except ImportError:
        return 0
    heads = {Qwen3_5Config: Qwen3_5MTPModel, Qwen3_5MoeConfig: Qwen3_5MoeMTPModel}.get(type(config))
    if heads is None or not getattr(config, "mtp_num_hidden_layers", 0) or "mtp" in config.model_classes:
        return 0
    config.model_classes["mtp"] = heads
    return 1


def apply(model: Any) -> dict[str, int]:
    """Every fix that applies to ``model``; how many places each changed (those that changed any)."""
    done = {
        "trim_gated_mlp_padding": trim_gated_mlp_padding(model),
        "strip_empty_key_prefix": strip_empty_key_prefix(model),
        "gemma3_image_attention": gemma3_image_attention(model),
    }
    return {k: v for k, v in done.items() if v}
