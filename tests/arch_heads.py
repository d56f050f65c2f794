"""A saved fixture checkpoint rewritten as the family's real checkpoints are laid out: its key prefix, its MTP head.

Qwen3.5 checkpoints keep the text model under ``model.language_model.`` (exllamav3 reads it there; transformers maps
it back onto ``Qwen3_5ForCausalLM``) and carry a multi-token-prediction head: ``mtp.fc`` (2H -> H) after two
RMSNorms (``pre_fc_norm_hidden``, ``pre_fc_norm_embedding``), ``mtp_num_hidden_layers`` full-attention decoder layers
(``mtp.layers.N.*``, shaped as the trunk's attention layers) and ``mtp.norm``. transformers ignores ``mtp.*`` when it
loads the model (its ``_keys_to_ignore_on_load_unexpected``); exllamav3 1.6.5 drafts with it (``qwen3_5_mtp.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def rewrite_checkpoint(out: Path, model: Any, key_prefix: str | None, mtp: bool, dtype: Any, seed: int) -> None:
    """Move ``model.`` keys under ``key_prefix`` and add an MTP head of ``mtp_num_hidden_layers`` layers."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    if key_prefix:
        tensors = {(key_prefix + k[len("model.") :] if k.startswith("model.") else k): v for k, v in tensors.items()}
    if mtp:
        tensors.update(mtp_head(model, dtype, seed))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():  # one shard at these sizes: the index would name keys that moved
        index.unlink()
    config = json.loads((out / "config.json").read_text())
    config.setdefault("mtp_num_hidden_layers", 1 if mtp else 0)
    (out / "config.json").write_text(json.dumps(config, indent=1))


def mtp_head(model: Any, dtype: Any, seed: int) -> dict[str, Any]:
    """An MTP head for a Qwen3.5 model: its decoder layers built by the model's own layer class (full attention)."""
    import copy

    import torch

    config = copy.deepcopy(model.config)
    layers = int(getattr(config, "mtp_num_hidden_layers", 1) or 1)
    config.layer_types = ["full_attention"] * max(layers, config.num_hidden_layers)
    layer_class = type(model.model.layers[-1])
    full = next(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    h = config.hidden_size
    g = torch.Generator().manual_seed(seed + 1000)
    out: dict[str, Any] = {
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(h),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        "mtp.norm.weight": torch.zeros(h),
    }
    torch.manual_seed(seed + 1000)
    for i in range(layers):
        layer = layer_class(config, full)  # the trunk's full-attention layer, new weights
        layer.apply(model._init_weights)
        for k, v in layer.state_dict().items():
            out[f"mtp.layers.{i}.{k}"] = v.detach().clone()
    return {k: v.to(dtype) for k, v in out.items()}


__all__ = ["mtp_head", "rewrite_checkpoint"]
