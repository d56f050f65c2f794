"""What a server of several models serves: each model's entry and the server's memory budget, read and checked.

An entry names a model directory (or Hub id) with its backend, load options, kind (``chat``, ``embedding`` or
``rerank``; found from the directory's files unless given), pinning (loaded at start and never unloaded),
``keep_alive`` (Ollama's meaning: how long after its last request the model stays loaded; 0: unloaded after each
request; negative: never unloaded for idleness) and, where the estimate from its files should not be used, its
memory. Entries come from the
command line (``serve DIR DIR ...``) or a config file (TOML, YAML or JSON)::

    gpu_memory = "20GiB"   # the budget models load within (default: 90% of the GPUs' memory, where there are GPUs)
    ram = "24GiB"          # (default: 90% of the memory available when the server starts)
    keep_alive = "5m"      # every model's, unless it sets its own (default: 5m, as Ollama)

    [[models]]
    name = "chat"                     # the name requests give as "model" (default: the directory's name)
    model_dir = "~/models/Qwen3-8B-exl3"
    backend = "exllamav3"
    pinned = true
    options = { cache_size = 32768 }

    [[models]]
    model_dir = "~/models/SmolLM2-135M-Instruct"
    keep_alive = 0

Sizes are bytes or a number with a unit (``KB``/``MB``/``GB`` are powers of 1000, ``KiB``/``MiB``/``GiB`` and a bare
``K``/``M``/``G`` powers of 1024); durations are seconds or Go-style (``"90s"``, ``"5m"``, ``"1h30m"``), as Ollama
takes them. Every unknown key is refused with the closest known one.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InvalidSettingsError, MissingDependencyError
from ...model.directory import model_name

KINDS = ("chat", "embedding", "rerank")
"""What a model serves: chat (and completions), embeddings, or rerank scores."""
DEFAULT_KEEP_ALIVE = 300.0
"""Seconds a model stays loaded after its last request, unless told otherwise (Ollama's default, 5 minutes)."""
CONFIG_LIMIT = 1 << 20
"""Largest config file read."""

_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_UNITS.update({f"{u}ib": 1024**i for i, u in enumerate("kmgt", 1)})
_UNITS.update({f"{u}b": 1000**i for i, u in enumerate("kmgt", 1)})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_size(value: Any, what: str) -> int:
    """Bytes from an int or a string such as ``"16GiB"`` (see the module docstring).

    Raises:
        InvalidSettingsError: not a size.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    found = _SIZE.match(value) if isinstance(value, str) else None
    unit = found.group(2).lower() if found else ""
    if found is None or unit not in _UNITS:
        raise InvalidSettingsError(f"{what} must be bytes or a size such as '16GiB' or '500MB', got {value!r}.")
    return int(float(found.group(1)) * _UNITS[unit])


def parse_duration(value: Any, what: str) -> float:
    """Seconds from a number or an Ollama duration (``"5m"``, ``"1h30m"``, ``"-1"``); negative means for ever.

    Raises:
        InvalidSettingsError: not a duration.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    text = value.strip() if isinstance(value, str) else ""
    try:
        return float(text)
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    parts = _DURATION_PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise InvalidSettingsError(
            f"{what} must be seconds or a duration such as '5m', '90s' or '1h30m' (negative: for ever), got {value!r}."
        )
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sign * sum(float(n) * scale[u] for n, u in parts)


@dataclass(frozen=True)
class ModelSpec:
    """One model a server serves (see the module docstring)."""

    name: str
    model_dir: str
    backend: str = "auto"
    options: Mapping[str, Any] = field(default_factory=dict)
    """Backend load options (``max_seq_len``, ``dtype``, exllamav3's ``cache_size`` ...)."""
    kind: str | None = None
    """``chat``, ``embedding`` or ``rerank``; None: found from the directory's files."""
    pinned: bool = False
    keep_alive: float | None = None
    """Seconds it stays loaded after its last request (0: unloaded after each; negative: for ever); None: the
    server's."""
    engines: int = 1
    gpu_memory: int | None = None
    """Bytes of GPU memory to count for it, instead of the estimate from its files."""
    ram: int | None = None
    """Bytes of memory to count for it, instead of the estimate from its files."""
    chat_template: str | None = None
    tool_format: str | None = None


@dataclass(frozen=True)
class ServerModels:
    """Every model a server serves, and the budget they load within."""

    models: tuple[ModelSpec, ...]
    gpu_memory: int | None = None
    """Bytes of GPU memory models may take at once; None: 90% of the GPUs' memory (0 where there is no GPU)."""
    ram: int | None = None
    """Bytes of memory models may take at once; None: 90% of what is available when the server starts."""
    keep_alive: float = DEFAULT_KEEP_ALIVE

    def __post_init__(self) -> None:
        if not self.models:
            raise InvalidSettingsError("serve needs at least one model (a directory, or a config file that names one).")
        seen: set[str] = set()
        for m in self.models:
            if m.name in seen:
                raise InvalidSettingsError(f"two models are named {m.name!r}; give each its own 'name'.")
            seen.add(m.name)

    @property
    def names(self) -> list[str]:
        """The models' names, in the order given (the first is the default of a request that names none)."""
        return [m.name for m in self.models]


_MODEL_KEYS = {f for f in ModelSpec.__dataclass_fields__} | {"model"}
_SERVER_KEYS = {"models", "gpu_memory", "ram", "keep_alive"}


def _check_keys(given: Mapping[str, Any], known: set[str], where: str) -> None:
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(sorted(known))}"
            raise InvalidSettingsError(f"{where}: unknown key {key!r}{hint}.")


def model_spec(entry: Mapping[str, Any], where: str, base: Path | None = None) -> ModelSpec:
    """One model's entry (a config file's table) as its spec; a relative ``model_dir`` is read from ``base``.

    Raises:
        InvalidSettingsError: an unknown key, a missing directory name, a bad value.
    """
    if not isinstance(entry, Mapping):
        raise InvalidSettingsError(f"{where} must be a table of keys (model_dir, name, backend ...).")
    _check_keys(entry, _MODEL_KEYS, where)
    raw = entry.get("model_dir", entry.get("model"))
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidSettingsError(f"{where} needs model_dir (a model directory or Hub id).")
    path = os.path.expanduser(raw)
    if base is not None and not os.path.isabs(path) and (base / path).exists():
        path = str(base / path)
    name = entry.get("name") or model_name(path) or path  # the model's own name (a Hub snapshot's: its repository's)
    kind = entry.get("kind")
    if kind is not None and kind not in KINDS:
        raise InvalidSettingsError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}.")
    options = entry.get("options") or {}
    if not isinstance(options, Mapping):
        raise InvalidSettingsError(f"{where}: options must be a table of backend load options.")
    engines = entry.get("engines", 1)
    if not isinstance(engines, int) or isinstance(engines, bool) or not 1 <= engines <= 64:
        raise InvalidSettingsError(f"{where}: engines must be an integer from 1 to 64, got {engines!r}.")
    keep = entry.get("keep_alive")

    def text(key: str) -> str | None:
        value = entry.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidSettingsError(f"{where}: {key} must be text, got {type(value).__name__}.")
        return value

    if not isinstance(name, str) or not 0 < len(name) <= 256 or not name.isprintable():
        raise InvalidSettingsError(f"{where}: name must be printable text of 1 to 256 characters, got {name!r}.")
    return ModelSpec(
        name=name,
        model_dir=path,
        backend=str(entry.get("backend", "auto")),
        options=dict(options),
        kind=kind,
        pinned=bool(entry.get("pinned", False)),
        keep_alive=None if keep is None else parse_duration(keep, f"{where}: keep_alive"),
        engines=engines,
        gpu_memory=None if entry.get("gpu_memory") is None else parse_size(entry["gpu_memory"], f"{where}: gpu_memory"),
        ram=None if entry.get("ram") is None else parse_size(entry["ram"], f"{where}: ram"),
        chat_template=text("chat_template"),
        tool_format=text("tool_format"),
    )


def server_models(data: Mapping[str, Any], where: str, base: Path | None = None) -> ServerModels:
    """A whole config (a file's contents, or the same keys from the command line) as what the server serves."""
    if not isinstance(data, Mapping):
        raise InvalidSettingsError(f"{where} must hold a table with a 'models' list.")
    _check_keys(data, _SERVER_KEYS, where)
    entries = data.get("models")
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
        raise InvalidSettingsError(f"{where} needs 'models', a list of model entries.")
    keep = data.get("keep_alive")
    return ServerModels(
        models=tuple(model_spec(e, f"{where}: models[{i}]", base) for i, e in enumerate(entries)),
        gpu_memory=None if data.get("gpu_memory") is None else parse_size(data["gpu_memory"], f"{where}: gpu_memory"),
        ram=None if data.get("ram") is None else parse_size(data["ram"], f"{where}: ram"),
        keep_alive=DEFAULT_KEEP_ALIVE if keep is None else parse_duration(keep, f"{where}: keep_alive"),
    )


def read_config(path: str | os.PathLike[str]) -> ServerModels:
    """A config file (``.toml``, ``.yaml``/``.yml`` or ``.json``) as what the server serves.

    Raises:
        InvalidSettingsError: the file cannot be read or parsed, or holds a bad entry.
        MissingDependencyError: a YAML file without PyYAML (or TOML on Python 3.10 without tomli).
    """
    p = Path(os.path.expanduser(os.fspath(path)))
    try:
        if p.stat().st_size > CONFIG_LIMIT:
            raise InvalidSettingsError(f"config file {str(p)!r} is over {CONFIG_LIMIT} bytes.")
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidSettingsError(f"cannot read config file {str(p)!r}: {e}.") from None
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            data = _toml().loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise MissingDependencyError("pyyaml", "serve", "YAML config files") from None
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise InvalidSettingsError(f"config file {str(p)!r} must end in .toml, .yaml, .yml or .json.")
    except (ValueError, RecursionError) as e:  # every parser's syntax error is a ValueError (yaml's is mapped below)
        raise InvalidSettingsError(f"config file {str(p)!r} does not parse: {e}") from None
    except Exception as e:
        if type(e).__module__.startswith("yaml"):
            raise InvalidSettingsError(f"config file {str(p)!r} does not parse: {e}") from None
        raise
    return server_models(data, f"config file {p.name!r}", p.parent)


def _toml() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise MissingDependencyError("tomli", "serve", "TOML config files on Python 3.10") from None
    return tomllib


__all__ = ["KINDS", "ModelSpec", "ServerModels", "parse_duration", "parse_size", "read_config", "server_models"]
