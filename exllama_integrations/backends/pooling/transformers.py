"""Embedding and rerank models on transformers (CPU, or any torch device): the reference the GPU path is checked by.

Encoders (BERT, MPNet, XLM-R ...) and decoder embedding models (Qwen3-Embedding style) load as the bare model
(``AutoModel``) and pool its last hidden state; cross-encoders load with their sequence-classification head
(``AutoModelForSequenceClassification``: sigmoid of one logit, or the softmax of the second of two); a causal LM
told to rerank (Qwen3-Reranker style) reads the probability of "yes" against "no" from its LM head at the last
token, applied to that token's state only.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import InvalidModelError, UnsupportedModelError
from ..base import require
from ..transformers import _load_bar, resolve_device_options
from .base import Encoded, PoolingBackend, PoolingOptions, ScoringTokens, padded, pool

if TYPE_CHECKING:
    import numpy as np

    from ...model.directory import ModelDirectory
    from ...model.pooling import PoolingConfig

logger = logging.getLogger(__name__)


class TransformersPooling(PoolingBackend):
    """transformers: encoders, decoder embedding models, cross-encoders and yes/no rerankers."""

    name = "transformers"

    @classmethod
    def resolve_options(cls, options: PoolingOptions) -> PoolingOptions:
        resolved: PoolingOptions = resolve_device_options(options)
        return resolved

    @classmethod
    def check_available(cls) -> None:
        require("torch", "transformers", "embedding and rerank models on transformers")
        require("transformers", "transformers", "embedding and rerank models on transformers")

    @classmethod
    def check_model(cls, model: ModelDirectory, pooling: PoolingConfig) -> None:
        from transformers import CONFIG_MAPPING

        if model.quantization is not None:
            raise UnsupportedModelError(
                f"{model.name!r} is {model.quantization}-quantized; transformers runs plain weights."
            )
        if model.model_type not in CONFIG_MAPPING:
            raise UnsupportedModelError(f"transformers does not know model_type {model.model_type!r} ({model.name!r}).")
        labels = model.config.get("id2label") or {}
        n = int(model.config.get("num_labels") or len(labels) or 1)
        if pooling.scoring == "classifier" and n > 2:
            raise UnsupportedModelError(f"{model.name!r} has {n} labels; a reranker's head has one (or two).")

    def __init__(
        self, model: ModelDirectory, pooling: PoolingConfig, options: PoolingOptions, tokens: ScoringTokens | None
    ) -> None:
        import torch
        import transformers

        options = self.resolve_options(options)
        self.pooling, self.tokens = pooling, tokens
        self.device = torch.device(options.device or "cpu")
        if options.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(options.num_threads)
        self.dtype = getattr(torch, options.dtype or "float32")
        if pooling.task == "embed":
            auto: Any = transformers.AutoModel
        elif pooling.scoring == "classifier":
            auto = transformers.AutoModelForSequenceClassification
        else:
            auto = transformers.AutoModelForCausalLM
        try:
            with _load_bar(options.progressbar):
                loaded: Any = auto.from_pretrained(
                    str(model.path),
                    local_files_only=True,
                    trust_remote_code=False,
                    use_safetensors=True,
                    output_loading_info=True,
                    dtype=self.dtype,
                )
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise InvalidModelError(f"transformers could not load {model.name!r}: {e}") from None
        self.model: Any = loaded[0]
        missing = [k for k in loaded[1].get("missing_keys", []) if not k.endswith("lm_head.weight")]
        if missing:
            del self.model
            raise InvalidModelError(
                f"weights are missing from {model.name!r}: {len(missing)} tensors ({', '.join(sorted(missing)[:5])})."
            )
        self.model.to(self.device).eval()
        cfg = self.model.config
        self.pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
        self.takes_types = "token_type_ids" in inspect.signature(self.model.forward).parameters
        if pooling.task == "embed":
            hidden = int(getattr(cfg, "hidden_size", 0) or getattr(getattr(cfg, "text_config", cfg), "hidden_size", 0))
            self.dimensions = hidden * len(pooling.modes)
        self.labels = int(getattr(cfg, "num_labels", 1) or 1)

    def _inputs(self, batch: Sequence[Encoded]) -> dict[str, Any]:
        import torch

        ids, mask, types = padded(batch, self.pad_id)
        out = {
            "input_ids": torch.tensor(ids, dtype=torch.long, device=self.device),
            "attention_mask": torch.tensor(mask, dtype=torch.long, device=self.device),
        }
        if types is not None and self.takes_types:
            out["token_type_ids"] = torch.tensor(types, dtype=torch.long, device=self.device)
        return out

    def embed(self, batch: Sequence[Encoded]) -> np.ndarray:
        import torch

        inputs = self._inputs(batch)
        with torch.inference_mode():
            states = self.model(**inputs).last_hidden_state
            pooled = pool(states, inputs["attention_mask"], self.pooling.modes, self.pooling.normalize)
        return pooled.float().cpu().numpy()

    def score(self, batch: Sequence[Encoded]) -> np.ndarray:
        import torch

        inputs = self._inputs(batch)
        with torch.inference_mode():
            if self.pooling.scoring == "classifier":
                logits = self.model(**inputs).logits.float()
                out = torch.sigmoid(logits[:, 0]) if self.labels == 1 else torch.softmax(logits, -1)[:, -1]
                return out.cpu().numpy()
            assert self.tokens is not None
            base = self.model.base_model
            states = base(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
            last = inputs["attention_mask"].sum(1) - 1
            at_last = states[torch.arange(states.shape[0], device=states.device), last]
            logits = self.model.get_output_embeddings()(at_last).float()
            pair = torch.stack([logits[:, self.tokens.no], logits[:, self.tokens.yes]], dim=-1)
            return torch.softmax(pair, -1)[:, 1].cpu().numpy()

    def close(self) -> None:
        if hasattr(self, "model"):
            del self.model
        import gc

        gc.collect()

    def info(self) -> dict[str, Any]:
        return {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", "")}


__all__ = ["TransformersPooling"]
