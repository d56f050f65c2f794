"""Inspecting a model directory before any backend touches it.

Everything a backend would trip over late (a missing config, truncated weights, pickle-only
checkpoints, paths that leave the directory, a config that disagrees with its weights, an
unreadable chat template) is found here first, with an error that says what to do. Files are read
under the rules of :mod:`.files` (regular files only, bounded sizes, one rule for links).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidModelError, ModelNotFoundError
from .config import check_config
from .files import (
    TEMPLATE_LIMIT,
    contained,
    parse_json,
    read_json,
    read_text,
    regular_file,
    safetensors_header,
)

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_name(path: str | os.PathLike[str]) -> str:
    """A model directory's name, as its model is named (the repository's, for a Hub snapshot), without reading it."""
    p = Path(path)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--")[-1]
    return p.name


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
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    chat_template: str | None = None
    """The model's chat template (tokenizer_config.json, chat_template.jinja or chat_template.json), or None."""

    @property
    def name(self) -> str:
        """The directory's name, used as the model name in metadata (the repository's, for a hub snapshot)."""
        return model_name(self.path)

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's part of config.json (``text_config`` of a multimodal model, else all of it)."""
        nested = self.config.get("text_config")
        return nested if isinstance(nested, dict) else self.config

    @property
    def tensor_names(self) -> frozenset[str]:
        """Names of every tensor in the weights."""
        return frozenset(self.tensor_shapes)

    @property
    def model_type(self) -> str:
        """config.json's ``model_type`` (e.g. ``llama``)."""
        return str(self.config.get("model_type", ""))

    @property
    def architectures(self) -> list[str]:
        """config.json's ``architectures``."""
        archs = self.config.get("architectures") or []
        return [str(a) for a in archs] if isinstance(archs, list) else []

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
        """The longest context the model was configured for (a multimodal model's is in its ``text_config``)."""
        for config in (self.config, self.text_config):
            for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
                v = config.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
        return 2048

    @classmethod
    def inspect(cls, path: str | os.PathLike[str]) -> ModelDirectory:
        """Check a model directory and describe it.

        Raises:
            ModelNotFoundError: the path does not exist or is not a directory.
            InvalidModelError: config.json, weights or tokenizer missing, malformed or truncated; a config
                that disagrees with the weights; files that are not regular files or link outside the directory.
        """
        raw = Path(os.path.expanduser(os.fspath(path)))
        try:
            exists, is_dir = raw.exists(), raw.is_dir()
        except OSError as e:  # a symlink loop, a name too long, ...
            raise ModelNotFoundError(f"model directory {str(raw)!r} cannot be opened: {e.strerror or e}.") from None
        if not exists:
            raise ModelNotFoundError(_not_found_message(raw, os.fspath(path)))
        if not is_dir:
            if raw.suffix.lower() == ".gguf":
                raise ModelNotFoundError(
                    f"{str(raw)!r} is a GGUF file (llama.cpp's format), which ExLlama does not load. Use the "
                    "model's safetensors release (fp16/bf16, GPTQ or EXL3) as a directory, or convert it to EXL3."
                )
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
            hint = ""
            if any(e.lower().endswith(".gguf") for e in entries):
                hint = " It holds GGUF files (llama.cpp's format), which ExLlama does not load."
            raise InvalidModelError(
                f"{str(root)!r} has no config.json; this does not look like a Hugging Face-layout model directory."
                + hint
            )

        def json_file(name: str) -> dict[str, Any]:
            return read_json(contained(root, name), name) if name in entries else {}

        config = json_file("config.json")
        if not config.get("model_type") and not config.get("architectures"):
            raise InvalidModelError("config.json names neither model_type nor architectures.")

        weights = cls._weights(root, entries)
        shapes: dict[str, tuple[int, ...]] = {}
        for w in weights:
            header = safetensors_header(w)
            shapes.update((k, tuple(v["shape"])) for k, v in header.items() if k != "__metadata__")
        if not shapes:
            raise InvalidModelError(f"the weights of {str(root)!r} hold no tensors; the files are incomplete.")
        check_config(config, shapes)

        tok_json = contained(root, "tokenizer.json") if "tokenizer.json" in entries else None
        tok_model = contained(root, "tokenizer.model") if "tokenizer.model" in entries else None
        if tok_json is None and tok_model is None:
            raise InvalidModelError(
                f"{str(root)!r} has no tokenizer.json or tokenizer.model; copy the tokenizer files next to the weights."
            )
        for p in (tok_json, tok_model):
            if p is not None:
                regular_file(p, p.name)
        tok_cfg = json_file("tokenizer_config.json")
        gen_cfg = json_file("generation_config.json")
        template = _chat_template(root, entries, tok_cfg)
        return cls(root, config, tuple(weights), tok_json, tok_model, tok_cfg, gen_cfg, shapes, template)

    @staticmethod
    def _weights(root: Path, entries: set[str]) -> list[Path]:
        index = "model.safetensors.index.json"
        if index in entries:
            data = read_json(contained(root, index), index)
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InvalidModelError(f"{index} has no weight_map.")
            if not all(isinstance(f, str) for f in weight_map.values()):
                raise InvalidModelError(f"{index}: every weight_map value must be a file name.")
            files = sorted({contained(root, f) for f in weight_map.values()})
            missing = [f.name for f in files if not os.path.lexists(f)]
            if missing:
                raise InvalidModelError(
                    f"weight files named in {index} are missing: {', '.join(missing)}; finish the download."
                )
            return files
        files = sorted(contained(root, e) for e in entries if e.endswith(".safetensors"))
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


def _chat_template(root: Path, entries: set[str], tok_cfg: dict[str, Any]) -> str | None:
    """The chat template, read and type-checked at load (a damaged one is reported here, not at the first chat)."""
    t = tok_cfg.get("chat_template")
    if isinstance(t, list):  # named templates: take "default"
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if t is not None and not isinstance(t, str):
        raise InvalidModelError(
            f"tokenizer_config.json: chat_template must be a string or a list of named templates, "
            f"got {type(t).__name__}; fix the file or pass chat_template= yourself."
        )
    if isinstance(t, str) and t.strip():
        return t
    if "chat_template.jinja" in entries:
        return read_text(contained(root, "chat_template.jinja"), "chat_template.jinja", TEMPLATE_LIMIT)
    if "chat_template.json" in entries:
        path = contained(root, "chat_template.json")
        data = parse_json(read_text(path, "chat_template.json", TEMPLATE_LIMIT), "chat_template.json", path)
        template = data.get("chat_template") if isinstance(data, dict) else None
        if not isinstance(template, str):
            raise InvalidModelError('chat_template.json must hold {"chat_template": "<template text>"}.')
        return template
    return None


def _not_found_message(raw: Path, given: str) -> str:
    msg = f"model directory {str(raw)!r} does not exist. Pass the folder that holds config.json"
    if HUB_ID.match(given):
        return (
            msg + f". {given!r} looks like a Hugging Face Hub id: pass it to `resolve_model_dir` / "
            "`from_model_id` to take it from the hub cache (or download it with "
            f"`hf download {given} --include '*.json' '*.safetensors' 'tokenizer*'`)."
        )
    return msg + ", or run `exllama-integrations demo` to prepare the demo model."
