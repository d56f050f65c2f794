"""``decode="fast"`` on MoE layers (issue 53): a Qwen3-MoE-shaped EXL3 checkpoint, captured where exllamav3 1.6.5's
MoE forward needs no host read, against exllamav3's own loop.

The checkpoint (tests/moe_models.py): 6 layers of 32 routed experts, top-8, 4-bit EXL3 (the fused kernels' mul1
codebook). Its steps of 1-8 rows run exllamav3's fused decode kernels inside our graph, 9-32 rows its sort path
(captured with the expert counts taken without a host read), 33-64 rows eagerly (the counts are read back on the
host there: block_sparse_mlp.py:1201), the report saying so. Qwen3-MoE declares MRoPE: its text steps' positions are
their cache lengths, captured too. Greedy tokens must be exllamav3's own at 1, 16 and 64 jobs.

Run on the lent GPU: ``bash tests/gpu/run_on_device.sh moe`` (or ``pytest -m gpu tests/gpu/test_gpu_fast_moe.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from moe_models import TOP_K, qwen3_moe_exl3

pytestmark = pytest.mark.gpu
PROMPT = "the quick brown fox jumps over the lazy dog and"


@pytest.fixture(scope="module")
def moe_exl3() -> Path:
    path, took = qwen3_moe_exl3()
    print(f"qwen3-moe EXL3 fixture: {path} {took}")
    return path


@pytest.fixture(scope="module")
def runtimes(moe_exl3: Path) -> Iterator[tuple[Any, Any]]:
    from exllama_integrations import ExLlamaRuntime

    with ExLlamaRuntime(moe_exl3, "exllamav3", cache_size=16384, decode="exllamav3") as plain:
        with ExLlamaRuntime(moe_exl3, "exllamav3", cache_size=16384) as fast:  # the default: decode="fast"
            yield plain, fast


def prompts(n: int) -> list[str]:
    return [f"{PROMPT} {i} {'again ' * (i % 5)}" for i in range(n)]


@pytest.mark.parametrize("jobs", [1, 16, 64])
def test_fast_greedy_tokens_on_moe_layers_are_exllamav3s(runtimes: tuple[Any, Any], jobs: int) -> None:
    plain, fast = runtimes
    graphs = fast.diagnostics()["fast_decode"].graphs
    replays, eager = graphs.replays, dict(graphs.eager)
    kw = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    want = [r.token_ids for r in plain.batch(prompts(jobs), **kw)]
    got = [r.token_ids for r in fast.batch(prompts(jobs), **kw)]
    assert got == want, f"{jobs} jobs"
    report = graphs.report()
    more = {k: n - eager.get(k, 0) for k, n in graphs.eager.items() if n > eager.get(k, 0)}
    print(f"moe {jobs} jobs: identical; replays +{graphs.replays - replays}, eager {more}")
    assert report["captured"] is True, report
    assert report["capture_failed"] == {}
    assert report["moe"]["layers"] == 6 and report["moe"]["captured_rows"] == f"1-{256 // TOP_K}"
    if jobs * TOP_K <= 256:  # the decode steps replayed (at 16 rows: exllamav3's sort path, captured)
        assert graphs.replays - replays >= 16, report
        assert not [k for k in more if k.startswith("MoE")], report
    else:  # 64 rows x top-8 > 256 picks: the step runs eagerly, and the report says which layers and why
        why = [k for k in more if k.startswith("MoE layers ran eagerly")]
        assert why, report
        assert any("64 rows x top-8 = 512 expert picks" in k and "read back on the host" in k for k in why), why


def test_the_report_says_which_rows_of_an_moe_model_are_captured(runtimes: tuple[Any, Any]) -> None:
    _, fast = runtimes
    report = fast.diagnostics()["fast_decode"].report()["graphs"]
    print(f"moe report: {report}")
    assert report["moe"]["eager_rows"] == f"{256 // TOP_K + 1}-{report['max_rows']}"
    assert "expert picks > the fused kernel's 256 rows" in report["moe"]["eager_why"]
