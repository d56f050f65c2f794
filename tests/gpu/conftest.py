"""Shared GPU fixtures: seeded random-weight Llama models, built once per session on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixture_models import SMALL_GQA, SMALL_MHA, SMALL_PADDED, make_llama


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "fp16-gqa": make_llama(root / "fp16-gqa", SMALL_GQA, seed=1),
        "fp16-mha": make_llama(root / "fp16-mha", SMALL_MHA, seed=2),
        "gptq": make_llama(root / "gptq", SMALL_GQA, seed=3, gptq=True),
        "fp16-pad": make_llama(root / "fp16-pad", SMALL_PADDED, seed=4),
    }
