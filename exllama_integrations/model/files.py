"""Reading a model directory's files: regular files only, bounded sizes, one rule for links.

The rule for links: a file the model uses must be named inside its directory (no absolute paths, no
``..``), and if that name is a symbolic link, its target must also lie inside the directory, or,
for a snapshot in the Hugging Face hub cache (``<repo>/snapshots/<revision>``), inside that
repository's ``blobs`` folder, where the hub keeps the real files. Anything else is refused, so a
``chat_template.jinja`` linked to a secret file is never rendered into a prompt. FIFOs, devices and
directories are refused where a file is expected (reading them would block or never end).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

from ..errors import InvalidModelError

KIB, MIB = 1024, 1024 * 1024
JSON_LIMIT = 64 * MIB
"""Largest JSON file read (config, tokenizer config, index, generation config)."""
TOKENIZER_LIMIT = 1024 * MIB
"""Largest tokenizer.json / tokenizer.model read."""
TEMPLATE_LIMIT = 16 * MIB
"""Largest chat template file read."""
HEADER_LIMIT = 100_000_000
"""Largest safetensors header (safetensors' own limit)."""

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def blobs_dir(root: Path) -> Path | None:
    """The hub cache's ``blobs`` folder for a snapshot directory ``<repo>/snapshots/<rev>``, if it is one.

    Only a real folder inside the repository counts: a ``blobs`` that is itself a link (to ``/``, say) would
    let a snapshot's links reach any file, so such a snapshot gets no ``blobs`` exception at all.
    """
    repo = root.parent.parent
    blobs = repo / "blobs"
    if root.parent.name != "snapshots" or blobs.is_symlink() or not blobs.is_dir():
        return None
    try:
        resolved, repo_resolved = blobs.resolve(strict=True), repo.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    return resolved if resolved.parent == repo_resolved else None


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def contained(root: Path, name: str) -> Path:
    """The path of ``name`` in ``root`` under the link rule (see the module docstring).

    Raises:
        InvalidModelError: the name or its link target leaves the directory.
    """
    if os.path.isabs(name):
        raise InvalidModelError(f"the model refers to the absolute path {name!r}; only files inside it are read.")
    lexical = Path(os.path.normpath(root / name))
    if not _within(lexical, root):
        raise InvalidModelError(f"the model refers to {name!r}, outside its directory; refusing to read it.")
    try:
        target = lexical.resolve(strict=False)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop on older Pythons
        raise InvalidModelError(f"{name!r} in the model directory is a symbolic link loop.") from None
    blobs = blobs_dir(root)
    if not (_within(target, root) or (blobs is not None and _within(target, blobs.resolve()))):
        raise InvalidModelError(
            f"{name!r} is a link to {str(target)!r}, outside the model directory; links may point only inside "
            "it (or, in a Hugging Face hub cache snapshot, into the repository's blobs folder). Copy the file in."
        )
    return lexical


def regular_file(path: Path, what: str) -> os.stat_result:
    """The file's stat, after checking it exists and is a regular file.

    Raises:
        InvalidModelError: missing, unreadable, a link loop, or not a regular file.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InvalidModelError(f"{what} at {path} is missing (or a link to a missing file).") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidModelError(f"{what} at {path} is a symbolic link loop.") from None
        raise InvalidModelError(f"cannot read {what} at {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise InvalidModelError(f"{what} at {path} is {kind}, not a regular file; replace it with the real file.")
    return st


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes."""
    st = regular_file(path, what)
    if st.st_size > limit:
        raise InvalidModelError(f"{what} at {path} is {st.st_size} bytes, more than the {limit} a {what} may be.")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise InvalidModelError(f"cannot read {what} at {path}: {e.strerror}") from None
    if len(data) > limit:
        raise InvalidModelError(f"{what} at {path} grew past {limit} bytes while it was read.")
    return data


def read_text(path: Path, what: str, limit: int) -> str:
    """A UTF-8 text file."""
    try:
        return read_bytes(path, what, limit).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidModelError(f"{what} at {path} is not UTF-8 text ({e.reason} at byte {e.start}).") from None


def parse_json(text: str | bytes, what: str, where: object) -> Any:
    """JSON with typed errors (malformed, or nested too deeply to parse)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidModelError(f"{what} at {where} is not valid JSON ({e}); re-download or re-export it.") from None
    except UnicodeDecodeError as e:
        raise InvalidModelError(f"{what} at {where} is not UTF-8 text ({e.reason}).") from None
    except RecursionError:
        raise InvalidModelError(f"{what} at {where} is nested too deeply to read.") from None


def read_json(path: Path, what: str, limit: int = JSON_LIMIT) -> dict[str, Any]:
    """A JSON object from a regular file of bounded size."""
    data = parse_json(read_bytes(path, what, limit), what, path)
    if not isinstance(data, dict):
        raise InvalidModelError(f"{what} at {path} must hold a JSON object, found {type(data).__name__}.")
    return data


def _valid_entry(v: Any) -> bool:
    if not isinstance(v, dict) or not isinstance(v.get("dtype"), str):
        return False
    shape, offsets = v.get("shape"), v.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return False
    return (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )


def safetensors_header(path: Path) -> dict[str, Any]:
    """Read and check a .safetensors header; raise InvalidModelError if it is truncated or malformed."""
    size = regular_file(path, "weight file").st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise InvalidModelError(f"{path.name} is truncated ({size} bytes); re-download it.")
            (n,) = struct.unpack("<Q", raw)
            if n > HEADER_LIMIT or 8 + n > size:
                raise InvalidModelError(f"{path.name} is truncated or not a safetensors file; re-download it.")
            header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise InvalidModelError(f"{path.name} has a corrupt safetensors header; re-download it.") from None
    except OSError as e:
        raise InvalidModelError(f"cannot read {path.name}: {e.strerror}") from None
    if not isinstance(header, dict):
        raise InvalidModelError(f"{path.name} has a corrupt safetensors header (not an object); re-download it.")
    bad = [k for k, v in header.items() if k != "__metadata__" and not _valid_entry(v)]
    if bad:
        raise InvalidModelError(
            f"{path.name} has a corrupt safetensors header (entry {bad[0]!r} lacks a dtype, shape or valid "
            "data_offsets); re-download it."
        )
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise InvalidModelError(
            f"{path.name} is truncated: its header describes {8 + n + end} bytes but the file has {size}; "
            "re-download it."
        )
    return header


def peft_adapter(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """A PEFT LoRA adapter's config and its weights file, checked before any backend reads them.

    Raises:
        InvalidSettingsError: not a directory, no adapter_config.json or adapter_model.safetensors (only
            safetensors are read), a config without ``r`` / ``lora_alpha``, or a corrupt weights header.
    """
    from ..errors import InvalidSettingsError

    root = Path(directory).expanduser()
    config_path, weights = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not root.is_dir():
        raise InvalidSettingsError(f"lora_dir {str(root)!r} is not a directory; give a PEFT adapter's folder.")
    if not config_path.is_file() or not weights.is_file():
        raise InvalidSettingsError(
            f"{root} is not a PEFT LoRA adapter: it needs adapter_config.json and adapter_model.safetensors "
            "(only safetensors are read; convert a .bin adapter with safetensors first)."
        )
    try:
        config = read_json(config_path, "adapter_config.json")
        safetensors_header(weights)
    except InvalidModelError as e:
        raise InvalidSettingsError(f"LoRA adapter {root}: {e}") from None
    if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), (int, float)):
        raise InvalidSettingsError(f"{config_path} lacks an integer 'r' and a numeric 'lora_alpha'.")
    if config.get("fan_in_fan_out"):
        raise InvalidSettingsError(f"{config_path}: fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported.")
    return config, weights
