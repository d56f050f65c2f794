"""Shared GPU fixtures: seeded random-weight Llama models, built once per session on the GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fixture_models import SMALL_GQA, SMALL_MHA, SMALL_PADDED, make_llama


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A case for a backend whose library is not installed on this machine is skipped, saying so."""
    for item in items:
        backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
        if backend is None:  # a test of one backend names it
            backend = "exllamav2" if "exllamav2" in item.name else "exllama" if "exllama_v1" in item.name else None
        if backend and importlib.util.find_spec(backend) is None:
            item.add_marker(pytest.mark.skip(reason=f"{backend} is not installed on this machine"))


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "fp16-gqa": make_llama(root / "fp16-gqa", SMALL_GQA, seed=1),
        "fp16-mha": make_llama(root / "fp16-mha", SMALL_MHA, seed=2),
        "gptq": make_llama(root / "gptq", SMALL_GQA, seed=3, gptq=True),
        "fp16-pad": make_llama(root / "fp16-pad", SMALL_PADDED, seed=4),
    }
