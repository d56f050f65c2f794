"""Hugging Face Hub ids (``org/name``) as model directories, through ``huggingface_hub``'s own cache.

``resolve_model_dir("org/name")`` returns the snapshot directory of that repository, downloading
only what a backend reads (config, tokenizer, safetensors; never pickles) with the hub's own
progress bars. ``HF_HUB_OFFLINE=1`` and the user's ``HF_HOME``/cache are honoured: offline, a
cached snapshot is used and a missing one is an error that says how to get it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import MissingDependencyError, ModelNotFoundError
from .directory import HUB_ID

logger = logging.getLogger(__name__)

ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.jinja",
    "*.txt",
]
"""What is taken from a repository: configs, tokenizers, templates and safetensors weights only."""


def is_hub_id(model: str | os.PathLike[str]) -> bool:
    """Whether ``model`` names a hub repository rather than an existing local path."""
    text = os.fspath(model)
    return bool(HUB_ID.match(text)) and not Path(os.path.expanduser(text)).exists()


def resolve_model_dir(model: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local directory for ``model``: the path itself, or the hub-cache snapshot of a hub id.

    Raises:
        ModelNotFoundError: a hub id that is not cached while offline, or that the hub does not have.
        MissingDependencyError: ``huggingface_hub`` is not installed (extra ``transformers``).
    """
    if not is_hub_id(model):
        return Path(os.path.expanduser(os.fspath(model)))
    repo = os.fspath(model)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise MissingDependencyError("huggingface_hub", "transformers", "Hugging Face Hub ids") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=offline)
    except LocalEntryNotFoundError:
        how = "unset HF_HUB_OFFLINE to download it, or " if offline else ""
        raise ModelNotFoundError(
            f"{repo!r} is not in the Hugging Face cache and could not be downloaded; {how}run "
            f"`hf download {repo} --include '*.json' '*.safetensors' 'tokenizer*'` where the hub is reachable, "
            "or pass a local model directory."
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFoundError(f"{repo!r} could not be fetched from the Hugging Face Hub: {e}") from None
    logger.info("hub id %s resolved to %s", repo, path)
    return Path(path)
