"""Fakes of exllamav3's module kinds for the fast path's CPU tests (tests/unit/test_fast_moe.py, _rings.py, _mamba.py).

The model view (``fast/seam/views.py``) tells a layer's kind by comparing ``type(module)`` to the boundary's names, so
a test hands its fakes out under those names (:func:`install`) and builds a model of them (:func:`fake_model`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

KIND_NAMES = (
    "Embedding", "TransformerBlock", "Attention", "SlidingAttention", "GatedDeltaNet", "Mamba2", "GatedMLP", "MLP",
    "BlockSparseMLP", "RMSNorm", "LayerNorm", "Linear",
)  # fmt: skip
"""The kinds the view asks the boundary for."""


class Kind:
    """A fake exllamav3 module kind: its attributes as given, on one device."""

    def __init__(self, **attrs: Any) -> None:
        self.device = "cuda:0"
        self.modules: list[Any] = []
        self.__dict__.update(attrs)

    def prepare_for_device(self, x: Any, params: dict[str, Any]) -> Any:
        return x


class Other(Kind):
    """Any kind a test does not tell apart."""


def install(monkeypatch: pytest.MonkeyPatch, *fakes: type) -> None:
    """The boundary hands ``fakes`` out as exllamav3's module kinds of their class names, every other kind of
    :data:`KIND_NAMES` as :class:`Other`, and exllamav3's graphed-batch bounds as 8 rows."""
    from exllama_integrations.backends.exllamav3 import upstream

    kinds = {fake.__name__: fake for fake in fakes}
    assert set(kinds) <= set(KIND_NAMES), set(kinds) - set(KIND_NAMES)
    for name in KIND_NAMES:
        monkeypatch.setitem(vars(upstream), name, kinds.get(name, Other))  # (an attribute comes before __getattr__)
    monkeypatch.setitem(vars(upstream), "MAX_BSZ", 8)
    monkeypatch.setitem(vars(upstream), "MAX_BSZN", 8)


def fake_model(embedding: Any, blocks: list[tuple[Any, int, Any]], norm: Any) -> Any:
    """A loaded single-device model of ``blocks`` (``fwd_modules`` entries) between an embedding and a final norm."""
    return SimpleNamespace(
        loaded_tp=False,
        caps={},
        _get_prefetch_layers=[],
        config=SimpleNamespace(moe_cpu_hosts=None),
        fwd_modules=[(embedding, 0, None), *blocks, (norm, 99, None)],
        modules=[],
        prepare_inputs=lambda ids, params: ids,
    )
