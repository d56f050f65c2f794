"""config.json checked against itself and against the weights, before any backend builds anything.

An absurd value (``num_hidden_layers`` of a billion, zero heads, a string where a size belongs)
would otherwise hang or crash model construction inside a library; a config that disagrees with
the weights (fewer layers than the file holds) would load and generate garbage.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidModelError

# Sizes a real model's config can hold, generously: anything outside is a broken file.
_LIMITS = {
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "vocab_size": 1 << 23,
    "max_position_embeddings": 1 << 24,
}
_LAYER = re.compile(r"^(?:model\.|transformer\.|gpt_neox\.)?(?:layers|h|blocks)\.(\d+)\.")


def _int_field(config: Mapping[str, Any], key: str) -> int | None:
    v = config.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise InvalidModelError(f"config.json: {key} must be an integer, got {v!r}; the file is damaged.")
    if not 1 <= v <= _LIMITS[key]:
        raise InvalidModelError(f"config.json: {key} is {v}, outside 1..{_LIMITS[key]}; the file is damaged.")
    return v


def check_config(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a config.json whose sizes are absurd or disagree with the tensors in the weights.

    Raises:
        InvalidModelError: naming the field and what the weights hold.
    """
    values = {k: _int_field(config, k) for k in _LIMITS}
    hidden, heads, kv = values["hidden_size"], values["num_attention_heads"], values["num_key_value_heads"]
    if hidden and heads and not values["head_dim"] and hidden % heads:
        raise InvalidModelError(
            f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; the file is damaged."
        )
    if heads and kv and heads % kv:
        raise InvalidModelError(
            f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}."
        )
    embed = shapes.get("model.embed_tokens.weight")
    if hidden and embed is not None and len(embed) == 2 and embed[1] != hidden:
        raise InvalidModelError(
            f"config.json says hidden_size {hidden}, but the weights' embedding is {embed[0]} x {embed[1]}; "
            "the config does not belong to these weights."
        )
    layers = values["num_hidden_layers"]
    if layers is None or "text_config" in config:  # multimodal configs nest the language model's sizes
        return
    present = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if not present:
        return
    extra = config.get("num_nextn_predict_layers") or 0  # e.g. DeepSeek's multi-token-prediction layer
    held = max(present) + 1
    if held != layers + (extra if isinstance(extra, int) else 0) and held != layers:
        more = "more" if held > layers else "fewer"
        raise InvalidModelError(
            f"config.json says num_hidden_layers is {layers}, but the weights hold {held} layers ({more}); "
            "the config does not belong to these weights."
        )
    missing = sorted(set(range(held)) - present)
    if missing:
        raise InvalidModelError(f"the weights lack every tensor of layer {missing[0]}; the files are incomplete.")
