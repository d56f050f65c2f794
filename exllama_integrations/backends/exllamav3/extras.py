"""What the exllamav3 backend loads beside the model: LoRA adapters and a draft model for speculative decoding.

LoRA: exllamav3 1.6.5 (``exllamav3/model/lora.py``) registers an adapter's A and B matrices on the target
``Linear`` modules and adds ``x @ A @ B`` in ``Linear.forward``. Its fused decode paths for EXL3 layers do
not call ``Linear.forward``: the graph-captured attention block (``Attention.bc_attn_step``), the fused K/V,
Q/gate and QKV multi-GEMMs, and the graphed single-token MLPs (``MLP.bc`` / ``GatedMLP.bc``, ``multi_gu``)
run the kernels directly, so an adapter would shape the prompt but not the decoded tokens. On the modules
an adapter touches we turn those paths off (``unfuse``); fp16/bf16 layers never take them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InvalidSettingsError, ModelLoadError, UnsupportedModelError
from ...model.directory import ModelDirectory
from ...model.hub import resolve_model_dir

if TYPE_CHECKING:
    from .options import ExLlamaV3Options

logger = logging.getLogger(__name__)

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj")


def load_loras(model: Any, adapters: list[tuple[dict[str, Any], Path]], scalings: list[float]) -> tuple[list[Any], int]:
    """Apply each adapter to the loaded ``model``, refusing one that matches no layer.

    ``adapters`` are what :func:`~exllama_integrations.runtime.files.peft_adapter` returned for them.
    Returns the adapters and how many fused decode paths were turned off for them.
    """
    if not adapters:
        return [], 0
    from .upstream import LoRA

    loras = []
    for (config, weights), scaling in zip(adapters, scalings):
        try:
            lora = LoRA.from_directory(model, str(weights.parent), scaling)
        except (KeyError, ValueError, RuntimeError) as e:
            raise InvalidSettingsError(f"exllamav3 could not apply the LoRA adapter {weights.parent}: {e}") from e
        if not lora.target_modules:
            raise InvalidSettingsError(
                f"the LoRA adapter {weights.parent} matches no layer of this model (targets "
                f"{config.get('target_modules')!r}); is it an adapter for another base model?"
            )
        loras.append(lora)
    n = unfuse(model)
    logger.info("exllamav3: %d LoRA adapter(s); %d fused decode paths turned off", len(loras), n)
    return loras, n


def _has_lora(linear: Any) -> bool:
    return bool(getattr(linear, "lora_a_tensors", None))


def _unload(obj: Any) -> None:
    if obj is not None and hasattr(obj, "unload"):
        obj.unload()


def unfuse(model: Any) -> int:
    """Turn off the fused paths that bypass ``Linear.forward`` on modules with a LoRA; returns how many were on."""
    from .upstream import MLP, Attention, GatedMLP

    n = 0
    for module in model:
        if isinstance(module, Attention) and any(_has_lora(getattr(module, p, None)) for p in _PROJECTIONS):
            n += getattr(module.q_proj, "quant_type", None) == "exl3"  # graph-eligible decode block
            for name in ("multi_kv", "multi_qg", "multi_qkv"):
                fused = getattr(module, name, None)
                n += fused is not None
                _unload(fused)
                setattr(module, name, None)
            module.bc_attn = {}
            module.bc_attn_step = _no_graph  # the instance attribute shadows the method
        elif isinstance(module, (MLP, GatedMLP)) and any(
            _has_lora(lin) for lin in [*module.ups, *module.downs, *getattr(module, "gates", [])]
        ):
            n += module.bc is not None
            module.bc = None
            if isinstance(module, GatedMLP):
                n += sum(gu is not None for gu in module.multi_gu)
                for gu in module.multi_gu:
                    _unload(gu)
                module.multi_gu = [None] * len(module.multi_gu)
    return n


def _no_graph(*args: Any, **kwargs: Any) -> None:
    return None  # "take the regular python path" in exllamav3's Attention.forward


def inspect_draft(options: ExLlamaV3Options, main: ModelDirectory) -> ModelDirectory | None:
    """The draft model's directory, checked against the main model before anything loads."""
    if not options.draft_model_dir:
        return None
    try:
        draft = ModelDirectory.inspect(resolve_model_dir(options.draft_model_dir))
    except ModelLoadError as e:
        raise type(e)(f"draft_model_dir: {e}") from None
    vocab, main_vocab = draft.config.get("vocab_size"), main.config.get("vocab_size")
    if vocab != main_vocab:
        raise InvalidSettingsError(
            f"the draft model {draft.name!r} has a vocabulary of {vocab} tokens and {main.name!r} one of "
            f"{main_vocab}; a draft model must share the main model's tokenizer."
        )
    if draft.quantization not in (None, "exl3"):
        raise UnsupportedModelError(
            f"the draft model {draft.name!r} is {draft.quantization}; exllamav3 drafts with EXL3 or fp16/bf16 weights."
        )
    return draft


def load_draft(
    draft: ModelDirectory, cache_tokens: int, cache_kw: dict[str, Any], load_kw: dict[str, Any]
) -> tuple[Any, Any]:
    """The draft model and its cache (exllamav3 needs it as large as the main cache)."""
    from . import patches
    from .upstream import Cache, Config, Model

    config = Config.from_directory(str(draft.path))
    model = Model.from_config(config)
    patches.apply(model)
    cache = Cache(model, max_num_tokens=cache_tokens, **cache_kw)
    model.load(**load_kw)
    return model, cache
