"""Decoder embedding and yes/no rerank models on exllamav3, from the final norm's state its forward exports.

exllamav3's ``Model.forward`` takes ``params["export_state_norm_keys"]``: each RMSNorm named there appends its
output to ``params["export_states"]`` (fp16, every position). Naming the model's final norm (the module before the
LM head, the one with ``caps["logits_output"]``) gives the last hidden state a transformers base model returns, so
it is pooled exactly as the transformers backend pools it. A batch runs without a cache (``attn_mode
"flash_attn_nc"``), right-padded: attention is causal, so no real token sees the padding after it, and positions
start at 0 in every row. ``last_tokens_only=1`` keeps the LM head to one position of the forward; a yes/no reranker
then runs the head on each row's last real state only.

What this relies on of exllamav3 (checked at load, refused with the reason otherwise): ``model.modules``, the head's
``caps["logits_output"]``, an RMSNorm with a ``key`` just before it, and the ``export_state_norm_keys`` parameter
(exllamav3 1.6.5).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import BackendUnavailableError, ModelLoadError, UnsupportedModelError
from ..base import cuda_available, require
from ..pooling.base import Encoded, PoolingBackend, PoolingOptions, ScoringTokens, padded, pool
from . import patches
from .options import show_progress

if TYPE_CHECKING:
    import numpy as np

    from ...model.directory import ModelDirectory
    from ...model.pooling import PoolingConfig

logger = logging.getLogger(__name__)


def final_norm(model: Any) -> tuple[Any, Any]:
    """The model's final norm (whose output is the last hidden state) and its LM head.

    Raises:
        UnsupportedModelError: the loaded model does not have the layout this relies on.
    """
    modules = list(getattr(model, "modules", []) or [])
    heads = [i for i, m in enumerate(modules) if getattr(m, "caps", {}).get("logits_output")]
    if len(heads) != 1 or heads[0] == 0:
        raise UnsupportedModelError("exllamav3's model has no single LM head after a final norm; cannot pool it.")
    norm = modules[heads[0] - 1]
    if type(norm).__name__ != "RMSNorm" or not isinstance(getattr(norm, "key", None), str):
        raise UnsupportedModelError(
            f"exllamav3's module before the LM head is {type(norm).__name__}, not the final RMSNorm; cannot pool it."
        )
    return norm, modules[heads[0]]


class ExLlamaV3Pooling(PoolingBackend):
    """exllamav3 on CUDA: decoder embedding models (EXL3 or fp16/bf16) and yes/no rerankers, batched."""

    name = "exllamav3"

    @classmethod
    def check_available(cls) -> None:
        import importlib.util

        if importlib.util.find_spec("exllamav3") is None:
            require("exllamav3", "exllamav3", "embedding and rerank models on exllamav3")
        if not cuda_available():
            raise BackendUnavailableError("exllamav3 needs a CUDA GPU, and torch sees none here.")

    @classmethod
    def check_model(cls, model: ModelDirectory, pooling: PoolingConfig) -> None:
        if not pooling.decoder:
            raise UnsupportedModelError(f"{model.name!r} is an encoder; exllamav3 runs decoder models only.")
        if pooling.task == "rerank" and pooling.scoring != "yes_no":
            raise UnsupportedModelError(f"{model.name!r} reranks with a classification head, which exllamav3 lacks.")
        if model.quantization not in (None, "exl3"):
            raise UnsupportedModelError(f"exllamav3 does not load {model.quantization}-quantized weights.")
        from .upstream import get_architectures

        archs = model.architectures
        if not archs or archs[0] not in get_architectures():
            raise UnsupportedModelError(f"architecture {archs[:1] or model.model_type!r} is not in exllamav3.")

    def __init__(
        self, model: ModelDirectory, pooling: PoolingConfig, options: PoolingOptions, tokens: ScoringTokens | None
    ) -> None:
        import torch

        from .upstream import Config, Model

        self.pooling, self.tokens = pooling, tokens
        self._model: Any = None
        overrides = patches.config_overrides(model.config)
        self._overlay = patches.overlay(model.path, overrides) if overrides else None
        try:
            config = Config.from_directory(self._overlay.name if self._overlay else str(model.path))
            self._model = Model.from_config(config)
            patches.apply(self._model)
            load: dict[str, Any] = {"progressbar": show_progress(options.progressbar)}
            if options.device:
                load["device"] = options.device
            self._model.load(**load)
            self._norm, self._head = final_norm(self._model)
        except Exception as e:
            self.close()
            if isinstance(e, (UnsupportedModelError, ModelLoadError)):
                raise
            raise ModelLoadError(f"exllamav3 could not load {model.name!r}: {type(e).__name__}: {e}") from e
        self.device = torch.device(options.device or "cuda:0")
        hidden = int(model.text_config.get("hidden_size") or 0)
        self.dimensions = hidden * len(pooling.modes) if pooling.task == "embed" else 0
        self.pad_id = int(model.config.get("pad_token_id") or 0)

    def _states(self, batch: Sequence[Encoded]) -> tuple[Any, Any]:
        """The final norm's output for every position of the padded batch, and the attention mask."""
        import torch

        ids, mask, _ = padded(batch, self.pad_id)
        params: dict[str, Any] = {
            "attn_mode": "flash_attn_nc",
            "export_state_norm_keys": {self._norm.key},
            "last_tokens_only": 1,
        }
        self._model.forward(torch.tensor(ids, dtype=torch.long), params)
        states = params.get("export_states") or []
        if len(states) != 1:
            raise UnsupportedModelError(f"exllamav3 exported {len(states)} states of the final norm, not one.")
        m = torch.tensor(mask, dtype=torch.long, device=states[0].device)
        return states[0], m

    def embed(self, batch: Sequence[Encoded]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            states, mask = self._states(batch)
            out = pool(states, mask, self.pooling.modes, self.pooling.normalize)
        return out.float().cpu().numpy()

    def score(self, batch: Sequence[Encoded]) -> np.ndarray:
        import torch

        assert self.tokens is not None
        with torch.inference_mode():
            states, mask = self._states(batch)
            last = states[torch.arange(states.shape[0], device=states.device), mask.sum(1) - 1]
            x = self._head.prepare_for_device(last.half().unsqueeze(1).contiguous(), {})
            logits = self._head.forward(x, {}).float().view(states.shape[0], -1)
            pair = torch.stack([logits[:, self.tokens.no], logits[:, self.tokens.yes]], dim=-1)
            return torch.softmax(pair, -1)[:, 1].cpu().numpy()

    def close(self) -> None:
        model, self._model = self._model, None
        if model is not None:
            try:
                model.unload()
            except Exception:  # noqa: BLE001 - best effort: free what can be freed
                logger.debug("exllamav3 unload failed", exc_info=True)
        if self._overlay is not None:
            self._overlay.cleanup()
            self._overlay = None
        import gc

        gc.collect()

    def info(self) -> dict[str, Any]:
        return {"device": str(self.device), "export_state": self._norm.key}


__all__ = ["ExLlamaV3Pooling", "final_norm"]
