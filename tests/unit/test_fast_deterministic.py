"""``deterministic=True``'s decode rule: each row of a step runs as a step of its own, with the table it gets alone.

The guarantee (a request's tokens as exllamav3's own loop gives it alone) is proven on the GPU
(tests/gpu/test_gpu_fast_decode.py); here, on the CPU, what each row's forward is handed. The prefill and prefix-cache
rules are tested through the seam in tests/unit/test_fast_seam.py, and the prefill's blocks against exllamav3's own
page table and Job.prefill in tests/unit/test_fast_chunks.py.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from exllama_integrations.backends.exllamav3.fast.deterministic import (  # noqa: E402
    refuse_chunks,
    row_width,
    rows_apart,
)
from exllama_integrations.backends.exllamav3.fast.requirements import PAGE_SIZE  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.step import Forward  # noqa: E402


def test_a_row_alone_gets_its_own_pages_padded_to_16_as_exllamav3_pads_a_step() -> None:
    assert row_width(0, PAGE_SIZE) == 16  # one page, padded
    assert row_width(16 * PAGE_SIZE - 1, PAGE_SIZE) == 16  # the 16th page's last position
    assert row_width(16 * PAGE_SIZE, PAGE_SIZE) == 32  # the 17th page: the next multiple of 16
    assert row_width(40 * PAGE_SIZE, PAGE_SIZE) == 48


def _call(ids: Any, params: dict[str, Any]) -> Forward:
    """The decode step as the seam hands it over (exllamav3 calls ``forward(input_ids=..., params=...)``)."""
    return Forward.of(lambda **k: None, (), {"input_ids": ids, "params": params})


def _step(lengths: list[int], width: int = 48) -> tuple[Any, dict[str, Any]]:
    rows = len(lengths)
    ids = torch.arange(rows).view(rows, 1)
    params = {
        "attn_mode": "flash_attn",
        "block_table": torch.arange(rows * width, dtype=torch.int32).view(rows, width),
        "cache_seqlens": torch.tensor(lengths, dtype=torch.int32),
        "recurrent_states": torch.arange(rows * 2.0).view(rows, 2),
        "dev_cache": {"the whole step's tables": "on the device"},
    }
    return ids, params


def test_each_row_runs_alone_with_the_table_exllamav3_gives_it_and_the_logits_come_back_in_order() -> None:
    ids, params = _step([5, 16 * PAGE_SIZE + 3, 300])
    seen: list[tuple[Any, dict[str, Any]]] = []

    def one(i: Any, p: dict[str, Any]) -> Any:
        seen.append((i, p))
        return torch.full((1, 1, 4), float(i.item()) + 0.5)

    out, apart = rows_apart(one, _call(ids, params))
    assert apart == 3 and [int(i.item()) for i, _ in seen] == [0, 1, 2]
    assert [p["block_table"].shape[1] for _, p in seen] == [16, 32, 16]  # each row's own width, not the step's 48
    for row, (_, p) in enumerate(seen):
        assert torch.equal(p["block_table"], params["block_table"][row : row + 1, : p["block_table"].shape[1]])
        assert p["cache_seqlens"].tolist() == [params["cache_seqlens"][row].item()]
        assert torch.equal(p["recurrent_states"], params["recurrent_states"][row : row + 1])
        assert "dev_cache" not in p and p["attn_mode"] == "flash_attn"  # the step's device copies are not reused
    assert out.shape == (3, 1, 4) and out[:, 0, 0].tolist() == [0.5, 1.5, 2.5]
    assert params["block_table"].shape == (3, 48)  # the step's own params are left as they were


def test_a_step_it_cannot_split_runs_whole() -> None:
    calls: list[int] = []

    def one(i: Any, p: dict[str, Any]) -> Any:
        calls.append(int(i.shape[0]))
        return torch.zeros((int(i.shape[0]), 1, 4))

    for ids, params in (
        _step([7]),  # one row: already alone
        (lambda s: (s[0], {**s[1], "positions": torch.zeros(2)}))(_step([7, 9])),  # explicit positions
        (lambda s: (s[0], {**s[1], "block_table": None}))(_step([7, 9])),  # no table to split
        (lambda s: (s[0], {**s[1], "block_table": s[1]["block_table"].to("meta")}))(_step([7, 9])),  # not on host
    ):
        calls.clear()
        _, apart = rows_apart(one, _call(ids, params))
        assert apart == 0 and calls == [int(ids.shape[0])]


def test_a_generator_whose_chunks_would_start_elsewhere_is_refused_saying_both_sizes() -> None:
    assert refuse_chunks(PAGE_SIZE, PAGE_SIZE) == 1 and refuse_chunks(2048, 2048) == 8  # K: pages a chunk
    for sizes in ((2048, PAGE_SIZE), (300, 300), (128, 128)):
        with pytest.raises(ValueError, match=f"same multiple of {PAGE_SIZE} \\(they are {sizes[0]} and {sizes[1]}\\)"):
            refuse_chunks(*sizes)
