"""Read each carried fixture with exllamav3's own Config and Model classes, on the CPU, before the GPU run.

exllamav3's C++/CUDA extension and Triton kernels are stubbed (nothing is computed), so this needs only the library's
Python source: ``pip download exllamav3==1.6.5 --no-deps`` and unzip the wheel. For each model directory it reports
the architecture exllamav3 picks (``architectures[0]``), whether its config class reads config.json (keys it requires,
values it asserts), whether its model class builds, the module keys whose tensors the checkpoint lacks and the
checkpoint tensors no module reads (a key-prefix or naming mismatch shows here, before any device time is spent).
Some reported keys are containers or optional tensors (a norm without a scale, a fused alternative): read the list.

    python tests/gpu/preflight_exllamav3.py --exllamav3 DIR_WITH_exllamav3_PACKAGE FIXTURES_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class _Stub(types.ModuleType):
    """A module whose every attribute is another stub; called as a decorator it returns the function."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Stub("call")


def _import_exllamav3(source: Path) -> Any:
    sys.path.insert(0, str(source))
    ext = _Stub("exllamav3.ext")
    ext.exllamav3_ext = _Stub("exllamav3_ext")
    sys.modules["exllamav3.ext"] = ext
    for name in ("triton", "triton.language", "triton.runtime", "marisa_trie"):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = _Stub(name)
    import exllamav3

    return exllamav3


def _modules(model: Any) -> Iterator[Any]:
    seen: set[int] = set()
    stack = list(model.modules)
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        stack.extend(getattr(m, "modules", None) or [])


def check(exllamav3: Any, directory: Path) -> dict[str, Any]:
    """What exllamav3's classes make of one model directory."""
    from safetensors import safe_open

    record: dict[str, Any] = {"fixture": directory.name}
    arch = json.loads((directory / "config.json").read_text()).get("architectures", ["?"])[0]
    record["architecture"] = arch
    from exllamav3.architecture.architectures import get_architectures

    record["known_to_exllamav3"] = arch in get_architectures()
    try:
        config = exllamav3.Config.from_directory(str(directory))
        model = exllamav3.Model.from_config(config)
    except Exception as e:  # noqa: BLE001 - recorded: this is what the check is for
        record["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        return record
    have: set[str] = set()
    for f in directory.glob("*.safetensors"):
        if f.name != "oracle.safetensors":
            with safe_open(str(f), "pt") as h:
                have |= set(h.keys())
    keys = {m.key for m in _modules(model) if isinstance(getattr(m, "key", None), str) and m.key}

    def reads(key: str, tensor: str) -> bool:
        return tensor == key or tensor.startswith((key + ".", key + "_"))

    record["config_class"] = type(config).__name__
    record["components"] = sorted(config.model_classes)
    record["modules_without_tensors"] = sorted(k for k in keys if not any(reads(k, t) for t in have))
    record["tensors_no_module_reads"] = sorted(t for t in have if not any(reads(k, t) for k in keys))
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exllamav3", type=Path, required=True, help="a folder holding the exllamav3 package")
    ap.add_argument("fixtures", type=Path)
    args = ap.parse_args()
    exllamav3 = _import_exllamav3(args.exllamav3)
    for d in sorted(p for p in args.fixtures.iterdir() if (p / "config.json").is_file()):
        print(json.dumps(check(exllamav3, d)), flush=True)


if __name__ == "__main__":
    main()
