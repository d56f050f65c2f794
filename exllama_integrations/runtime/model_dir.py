"""Inspecting a model directory before any backend touches it.

Everything a backend would trip over late (a missing config, truncated weights, pickle-only
checkpoints, paths that leave the directory) is found here first, with an error that says what to do.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidModelError, ModelNotFoundError

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise InvalidModelError(f"{what} at {path} is not valid JSON ({e}); re-download or re-export it.") from None
    except OSError as e:
        raise InvalidModelError(f"cannot read {what} at {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise InvalidModelError(f"{what} at {path} must hold a JSON object, found {type(data).__name__}.")
    return data


def _inside(root: Path, name: str) -> Path:
    """Resolve ``name`` under ``root``; refuse anything that would leave the directory."""
    if os.path.isabs(name):
        raise InvalidModelError(f"the model refers to the absolute path {name!r}; only files inside it are read.")
    p = (root / name).resolve()
    if p != root and root not in p.parents:
        raise InvalidModelError(f"the model refers to {name!r}, outside its directory; refusing to read it.")
    return p


def safetensors_header(path: Path) -> dict[str, Any]:
    """Read and check a .safetensors header; raise InvalidModelError if the file is truncated."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise InvalidModelError(f"{path.name} is truncated ({size} bytes); re-download it.")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000 or 8 + n > size:
                raise InvalidModelError(f"{path.name} is truncated or not a safetensors file; re-download it.")
            header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidModelError(f"{path.name} has a corrupt safetensors header; re-download it.") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise InvalidModelError(
            f"{path.name} is truncated: its header describes {8 + n + end} bytes but the file has {size}; "
            "re-download it."
        )
    return header


@dataclass(frozen=True)
class ModelDirectory:
    """What a model directory holds, checked. Built with :meth:`inspect`."""

    path: Path
    config: dict[str, Any]
    weight_files: tuple[Path, ...]
    tokenizer_json: Path | None
    tokenizer_model: Path | None
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    tensor_names: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        """The directory's name, used as the model name in metadata."""
        return self.path.name

    @property
    def model_type(self) -> str:
        """config.json's ``model_type`` (e.g. ``llama``)."""
        return str(self.config.get("model_type", ""))

    @property
    def architectures(self) -> list[str]:
        """config.json's ``architectures``."""
        return list(self.config.get("architectures") or [])

    @property
    def quantization(self) -> str | None:
        """The quantization method named in config.json (``gptq``, ``exl3``, ...) or None for plain weights."""
        q = self.config.get("quantization_config")
        if isinstance(q, dict):
            return str(q.get("quant_method", "unknown")).lower()
        if (self.path / "quantize_config.json").exists():
            return "gptq"
        return None

    @property
    def context_length(self) -> int:
        """The longest context the model was configured for."""
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            v = self.config.get(key)
            if isinstance(v, int) and v > 0:
                return v
        return 2048

    @classmethod
    def inspect(cls, path: str | os.PathLike[str]) -> ModelDirectory:
        """Check a model directory and describe it.

        Raises:
            ModelNotFoundError: the path does not exist or is not a directory.
            InvalidModelError: config.json, weights or tokenizer missing, malformed or truncated.
        """
        raw = Path(os.path.expanduser(os.fspath(path)))
        if not raw.exists():
            raise ModelNotFoundError(
                f"model directory {str(raw)!r} does not exist. Pass the folder that holds config.json, "
                "or run `exllama-integrations demo` to prepare the demo model."
            )
        if not raw.is_dir():
            raise ModelNotFoundError(f"{str(raw)!r} is a file, not a model directory; pass the folder that holds it.")
        root = raw.resolve()
        try:
            entries = {p.name for p in root.iterdir()}
        except PermissionError:
            raise InvalidModelError(f"cannot list {str(root)!r}: permission denied.") from None
        if not entries:
            raise InvalidModelError(
                f"model directory {str(root)!r} is empty; it needs config.json, weights and a tokenizer."
            )
        if "config.json" not in entries:
            raise InvalidModelError(
                f"{str(root)!r} has no config.json; this does not look like a Hugging Face-layout model directory."
            )
        config = _read_json(root / "config.json", "config.json")
        if not config.get("model_type") and not config.get("architectures"):
            raise InvalidModelError("config.json names neither model_type nor architectures.")

        weights = cls._weights(root, entries)
        names: set[str] = set()
        for w in weights:
            names.update(k for k in safetensors_header(w) if k != "__metadata__")

        tok_json = root / "tokenizer.json" if "tokenizer.json" in entries else None
        tok_model = root / "tokenizer.model" if "tokenizer.model" in entries else None
        if tok_json is None and tok_model is None:
            raise InvalidModelError(
                f"{str(root)!r} has no tokenizer.json or tokenizer.model; copy the tokenizer files next to the weights."
            )
        tok_cfg = (
            _read_json(root / "tokenizer_config.json", "tokenizer_config.json")
            if ("tokenizer_config.json" in entries)
            else {}
        )
        gen_cfg = (
            _read_json(root / "generation_config.json", "generation_config.json")
            if ("generation_config.json" in entries)
            else {}
        )
        return cls(root, config, tuple(weights), tok_json, tok_model, tok_cfg, gen_cfg, frozenset(names))

    @staticmethod
    def _weights(root: Path, entries: set[str]) -> list[Path]:
        index = "model.safetensors.index.json"
        if index in entries:
            data = _read_json(root / index, index)
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InvalidModelError(f"{index} has no weight_map.")
            files = sorted({_inside(root, str(f)) for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise InvalidModelError(
                    f"weight files named in {index} are missing: {', '.join(missing)}; finish the download."
                )
            return files
        files = sorted(root / e for e in entries if e.endswith(".safetensors"))
        if files:
            return files
        pickles = sorted(e for e in entries if e.endswith(_PICKLE_SUFFIXES))
        if pickles:
            raise InvalidModelError(
                f"{str(root)!r} holds only pickle checkpoints ({', '.join(pickles)}). Weights are loaded only from "
                "safetensors, which cannot run code; convert them (e.g. `model.save_pretrained(dir, "
                "safe_serialization=True)` in a trusted environment)."
            )
        raise InvalidModelError(f"{str(root)!r} has no *.safetensors weights.")
