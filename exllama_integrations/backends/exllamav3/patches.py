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
    from .upstream import GatedMLP

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
    """Keys to add to config.json for exllamav3; empty when none are needed.

    See ``RENAMED_CONFIG_KEYS`` and ``gemma4_global_attention``.
    """
    renamed = RENAMED_CONFIG_KEYS.get(str(config.get("model_type")), {})
    out = {want: config[have] for want, have in renamed.items() if want not in config and have in config}
    return {**out, **gemma4_global_attention(config)}


GEMMA4_TYPES = ("gemma4", "gemma4_unified")


def gemma4_global_attention(config: dict[str, Any]) -> dict[str, Any]:
    """Work around exllamav3 (1.6.5) on Gemma 4 directories saved by transformers 5 (a fine-tune, a re-save).

    Gemma 4's full-attention layers have their own head size and KV heads: Google's checkpoints write them as
    ``text_config.global_head_dim`` (512 beside ``head_dim`` 256) and ``num_global_key_value_heads``, which is what
    exllamav3 reads (architecture/gemma4.py). transformers 5.24's ``Gemma4TextConfig`` turns them into
    ``per_layer_config`` (``{"5": {"head_dim": 512, ...}}`` for each full layer) and ``save_pretrained`` writes only
    that, so exllamav3 falls back to ``head_dim`` for the full layers and the load fails ("source shape (256, 256) ...
    does not fit destination (256, 128)" on a full layer's q_proj). The values are the same: exllamav3 is handed
    ``text_config`` with the two keys written back, when every full layer carries the same override and no sliding
    layer carries one (what transformers derives from the two keys); otherwise nothing is added and the load fails
    as before. Returns ``{"text_config": ...}`` or nothing.
    """
    text = config.get("text_config")
    if config.get("model_type") not in GEMMA4_TYPES or not isinstance(text, dict) or "global_head_dim" in text:
        return {}
    layers, types = text.get("per_layer_config"), text.get("layer_types")
    if not isinstance(layers, dict) or not isinstance(types, list):
        return {}
    full = {str(i) for i, t in enumerate(types) if t == "full_attention"}
    rows = [layers.get(i) for i in sorted(full)]
    if not full or set(map(str, layers)) != full or any(r != rows[0] for r in rows) or not isinstance(rows[0], dict):
        return {}
    row = rows[0]
    if set(row) - {"head_dim", "num_key_value_heads"} or not isinstance(row.get("head_dim"), int):
        return {}
    keys = {"global_head_dim": row["head_dim"]}
    if isinstance(row.get("num_key_value_heads"), int):
        keys["num_global_key_value_heads"] = row["num_key_value_heads"]
    return {"text_config": {**text, **keys}}


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
        from .upstream import Gemma3Model, _prepare_noncausal_mm_spans
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
        from .upstream import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeMTPModel, Qwen3_5MTPModel
    except ImportError:
        return 0
    heads = {Qwen3_5Config: Qwen3_5MTPModel, Qwen3_5MoeConfig: Qwen3_5MoeMTPModel}.get(type(config))
    if heads is None or not getattr(config, "mtp_num_hidden_layers", 0) or "mtp" in config.model_classes:
        return 0
    config.model_classes["mtp"] = heads
    return 1


def split_fused_expert(fused: Any, bias: Any, rows: tuple[int, int] | None, interleaved: bool) -> tuple[Any, Any]:
    """One expert projection from its fused checkpoint tensor, as exllamav3 reads GPT-OSS's MXFP4 experts.

    ``fused`` is the expert's slice in (out, in) orientation (``gate_up_proj[e].T``: 2 x intermediate rows),
    ``bias`` its (out,) bias or None, ``rows`` the (start, end) of this projection among the rows (gate: the first
    intermediate_size, up: the second) and ``interleaved`` whether gate and up rows alternate (GPT-OSS: gate = rows
    0, 2, 4, ..., up = 1, 3, 5, ...; transformers' ``gate_up[..., ::2]``, ``[..., 1::2]``). Returns the weight in
    (in, out) orientation and the bias, sliced alike (exllamav3's linear.py MXFP4 branch, on a plain tensor).
    """
    if rows is not None:
        n = rows[1] - rows[0]
        pick = slice(rows[0] // n, None, fused.shape[0] // n) if interleaved else slice(rows[0], rows[1])
        fused = fused[pick]
        bias = bias[pick] if bias is not None else None
    return fused.T.contiguous(), bias


def gpt_oss_bf16_experts(model: Any) -> int:
    """Work around exllamav3 (1.6.5) on GPT-OSS checkpoints in bf16 (dequantized, or saved by transformers).

    GPT-OSS keeps each layer's experts fused: ``mlp.experts.gate_up_proj`` (experts, hidden, 2 x intermediate) with
    gate and up columns interleaved, ``down_proj``, and the biases ``gate_up_proj_bias`` and ``down_proj_bias``.
    exllamav3 reads them right from the MXFP4 checkpoint (``_blocks``/``_scales``: rows interleaved, bias read), but
    a plain tensor takes linear.py's fused branch written for Qwen3-VL-MoE, which slices the rows in contiguous
    halves (``finterleaved`` unused) and passes no bias: every expert's gate and up pair the wrong columns and lose
    their biases, so bf16 GPT-OSS logits part from transformers' (3.28 on an H200, tolerance 0.03; this reading
    redone in torch on the CPU, on a model of that size: 3.10).
    This gives each expert linear of a GPT-OSS model a loader that reads the plain tensor as the MXFP4 branch reads
    the quantized one (``split_fused_expert``); MXFP4 and EXL3 weights, and per-expert keys, load as before.
    Returns how many expert linears got it.
    """
    try:
        from .upstream import BlockSparseMLP, GptOssModel
    except ImportError:
        return 0
    if not isinstance(model, GptOssModel):
        return 0
    n = 0
    for module in model:
        if not isinstance(module, BlockSparseMLP):
            continue
        for linear in (*module.gates, *module.ups, *module.downs):
            if not linear.fkey or linear.fidx is None or getattr(linear, "_fused_bf16_patched", False):
                continue
            if linear.frange_dim != 0 or not linear.ftranspose_after_load or not linear.transpose_fused_weights:
                continue
            linear.load_fp16 = _fused_expert_loader(linear, linear.load_fp16)
            linear._fused_bf16_patched = True
            n += 1
    return n


def _fused_expert_loader(linear: Any, plain: Any) -> Any:
    def load_fp16(key: str) -> bool:
        stc = linear.config.stc
        if not stc.has_tensor(linear.fkey) or stc.has_tensor_group(key, ["weight"]) or linear.is_sliced:
            return bool(plain(key))
        from .upstream import LinearFP16

        fused = stc.get_tensor(linear.fkey, linear.device, transpose=True, no_defer=True, fidx=linear.fidx)
        bias = stc.get_tensor(linear.fkey + "_bias", linear.device, optional=True, no_defer=True, fidx=linear.fidx)
        weight, bias = split_fused_expert(fused, bias, linear.frange, linear.finterleaved)
        weight, bias = linear.pad_out(weight), linear.pad_out(bias)
        if linear.weight_scale != 1.0:
            weight = (weight.float() * linear.weight_scale).to(weight.dtype)
            bias = None if bias is None else (bias.float() * linear.weight_scale).to(bias.dtype)
        linear.inner = LinearFP16(
            linear.in_features,
            linear.out_features,
            weight,
            bias,
            linear.full_in_features,
            linear.full_out_features,
            linear.first_in_feature,
            linear.first_out_feature,
            out_dtype=linear.out_dtype,
            key=linear.key,
        )
        linear.quant_type = "fp16"
        return True

    return load_fp16


def apply(model: Any) -> dict[str, int]:
    """Every fix that applies to ``model``; how many places each changed (those that changed any)."""
    done = {
        "trim_gated_mlp_padding": trim_gated_mlp_padding(model),
        "strip_empty_key_prefix": strip_empty_key_prefix(model),
        "gemma3_image_attention": gemma3_image_attention(model),
        "gpt_oss_bf16_experts": gpt_oss_bf16_experts(model),
    }
    return {k: v for k, v in done.items() if v}
