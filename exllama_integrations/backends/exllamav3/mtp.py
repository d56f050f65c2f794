"""``draft="mtp"``: the checkpoint's own multi-token-prediction heads as exllamav3's drafter, checked before loading.

exllamav3 1.6.5 builds a checkpoint's MTP head as a component of the model's own config
(``Model.from_config(config, component="mtp")``, as its ``model_init --mtp`` and TabbyAPI's ``draft_mode: mtp`` do):
a small model that borrows the target's embedding and LM head (``attach_to``, when the Generator is built), reads
the target's last hidden state and the last token, and drafts one token per call; the Generator verifies the
drafted window in one target forward. It has a K/V cache of its own, as large as the main one (the Generator's
rule), holding only its few attention layers.

Before anything loads, :func:`mtp_layers` refuses a checkpoint that carries no heads, saying what it lacks: the
config's count of them (``mtp_num_hidden_layers``: Qwen3.5/3.6; ``num_nextn_predict_layers``: DeepSeek, GLM,
Nemotron-H, MiMo) or their weights (``mtp.*`` keys, or layers past ``num_hidden_layers``, where GLM keeps them).
:func:`build_mtp` then refuses an architecture exllamav3 has no MTP drafter for.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ...errors import UnsupportedModelError
from . import patches

if TYPE_CHECKING:
    from ...model.directory import ModelDirectory
    from .options import ExLlamaV3Options

COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
"""The config keys that count a checkpoint's MTP layers (in ``text_config`` for a multimodal model)."""

_MTP_KEY = re.compile(r"(?:^|\.)mtp\.")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

_ELSE = "use a checkpoint that ships them (some quantizations drop them), or draft_model_dir or ngram_match_min"


def mtp_layers(options: ExLlamaV3Options, model: ModelDirectory) -> int:
    """How many MTP layers ``model`` carries when ``draft="mtp"`` asks for them (0 when it does not ask).

    Raises:
        UnsupportedModelError: ``draft="mtp"`` and the checkpoint lacks its heads (the message says what is missing).
    """
    if options.draft != "mtp":
        return 0
    config = model.text_config
    counts = {k: config.get(k, model.config.get(k)) for k in COUNT_KEYS}
    named = {k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    if not named:
        said = ", ".join(f"{k}={v!r}" for k, v in counts.items() if v is not None) or "neither"
        raise UnsupportedModelError(
            f"draft='mtp' drafts with the checkpoint's own MTP heads, and {model.name!r} declares none: its "
            f"config.json sets no positive {' or '.join(COUNT_KEYS)} ({said}); {_ELSE}."
        )
    key, layers = next(iter(named.items()))
    trunk = int(config.get("num_hidden_layers") or 0)
    tensors = model.tensor_names
    if not any(_MTP_KEY.search(t) or _past_trunk(t, trunk) for t in tensors):
        raise UnsupportedModelError(
            f"draft='mtp': {model.name!r} declares {layers} MTP layer(s) ({key}) but its weights hold none of them "
            f"(no mtp.* tensors, nor layers past its {trunk} hidden layers, among {len(tensors)} tensors); {_ELSE}."
        )
    return layers


def _past_trunk(name: str, trunk: int) -> bool:
    m = _LAYER.search(name)
    return trunk > 0 and m is not None and int(m.group(1)) >= trunk


def build_mtp(config: Any, architecture: str) -> tuple[Any, dict[str, int]]:
    """exllamav3's MTP model for ``config`` (built, not loaded), and the upstream fixes it took (:mod:`.patches`).

    Raises:
        UnsupportedModelError: exllamav3 has no MTP drafter for this architecture (or found no heads itself).
    """
    from importlib.metadata import version

    from .upstream import Model

    fixes = {"qwen3_5_text_mtp": patches.qwen3_5_text_mtp(config)}
    if "mtp" not in config.model_classes:
        raise UnsupportedModelError(
            f"draft='mtp': exllamav3 {version('exllamav3')} has no MTP drafter for {architecture} (or does not find "
            f"its heads in the weights); {_ELSE}."
        )
    model = Model.from_config(config, component="mtp")
    fixes |= {f"mtp_head.{k}": v for k, v in patches.apply(model).items()}
    return model, {k: v for k, v in fixes.items() if v}


def load_mtp(model: Any, cache_tokens: int, cache_kw: dict[str, Any], load_kw: dict[str, Any]) -> Any:
    """Load the built MTP ``model`` and return its cache (as large as the main cache, as exllamav3 requires)."""
    from .upstream import Cache

    cache = Cache(model, max_num_tokens=cache_tokens, **cache_kw)
    model.load(**load_kw)
    return cache


def default_draft(model: Any) -> int:
    """Tokens the MTP head drafts a step unless ``num_draft_tokens`` says (exllamav3's per-architecture default)."""
    return int(model.caps.get("default_draft_size", 4))
