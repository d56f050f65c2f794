"""A tokenizer's files without a model: what a server shares so its clients count tokens and render prompts exactly."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidModelError

if TYPE_CHECKING:
    from .tokenizer import TokenizerSource


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer's files without a model (what a server shares with its clients); a TokenizerSource."""

    name: str
    tokenizer_json: Path | None
    tokenizer_model: Path | None
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None

    @staticmethod
    def bundle(source: TokenizerSource) -> dict[str, Any]:
        """The files of ``source`` as plain data (JSON-safe; tokenizer.model base64-encoded)."""
        from .files import TOKENIZER_LIMIT, read_bytes, read_text

        ids = {k: source.config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        return {
            "name": source.name,
            "tokenizer.json": read_text(source.tokenizer_json, "tokenizer.json", TOKENIZER_LIMIT)
            if source.tokenizer_json
            else None,
            "tokenizer.model": base64.b64encode(
                read_bytes(source.tokenizer_model, "tokenizer.model", TOKENIZER_LIMIT)
            ).decode()
            if source.tokenizer_model and not source.tokenizer_json
            else None,
            "tokenizer_config": source.tokenizer_config,
            "generation_config": source.generation_config,
            "config": {k: v for k, v in ids.items() if v is not None},
            "chat_template": source.chat_template,
        }

    @classmethod
    def from_bundle(cls, bundle: dict[str, Any], folder: Path) -> TokenizerFiles:
        """Write a bundle's tokenizer file under ``folder`` (named by its content) and describe it."""
        import hashlib

        text, model = bundle.get("tokenizer.json"), bundle.get("tokenizer.model")
        if not isinstance(text, str) and not isinstance(model, str):
            raise InvalidModelError("the server shared no tokenizer.json or tokenizer.model.")
        data = text.encode() if isinstance(text, str) else base64.b64decode(model or "")
        name = "tokenizer.json" if isinstance(text, str) else "tokenizer.model"
        path = folder / hashlib.sha256(data).hexdigest()[:32] / name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        template = bundle.get("chat_template")
        return cls(
            name=str(bundle.get("name") or "model"),
            tokenizer_json=path if name == "tokenizer.json" else None,
            tokenizer_model=path if name == "tokenizer.model" else None,
            tokenizer_config=dict(bundle.get("tokenizer_config") or {}),
            generation_config=dict(bundle.get("generation_config") or {}),
            config=dict(bundle.get("config") or {}),
            chat_template=template if isinstance(template, str) else None,
        )
