"""``decode="fast"`` on Mamba-2 hybrids (issue 53): a Nemotron-H-shaped model in bf16 and in 4-bit EXL3 against
exllamav3's own loop, its decode steps captured (tests/mamba_models.py builds both with transformers' own classes).

Greedy tokens must be exllamav3's own at 1, 8, 16 and 64 jobs, and the report must say the Mamba-2 layers were
captured. On bf16 weights (no ``BC_Mamba2``: exllamav3's torch path at every row count) every row count is captured,
the steps after each shape's first replayed; on EXL3 weights up to 8 rows exllamav3's own graphed ``BC_Mamba2`` runs
(left to it, and the report counts those steps under that reason), above it the step is captured. A fixture that was
not built (``MAMBA_FIXTURES`` picks them; the EXL3 conversion is the slow one) is skipped with its reason.

Run on the lent GPU: ``bash tests/gpu/run_on_device.sh mamba`` (or ``pytest -m gpu tests/gpu/test_gpu_fast_mamba.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from mamba_models import FIXTURES

from helpers import plain_and_fast

pytestmark = pytest.mark.gpu
NEW = 32
WORDS = "the sea and its tides its fish its ships a harbour at dawn the wind in the sails".split()
OWN_ROWS = "up to 8 rows (left to exllamav3's own per-layer graphs)"
CHOSEN = [n for n in os.environ.get("MAMBA_FIXTURES", ",".join(sorted(FIXTURES))).split(",") if n]


@pytest.fixture(scope="module", params=CHOSEN)
def runtimes(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, Any]]:
    with plain_and_fast(request.param, FIXTURES, cache_size=32768) as loaded:  # 64 jobs x ~300 tokens
        yield loaded


def prompts(n: int) -> list[str]:
    """``n`` prompts of different lengths (about 40 to 250 words), so that jobs start and step out of phase."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40 + (i * 53) % 211)) for i in range(n)]


@pytest.mark.parametrize("jobs", [1, 8, 16, 64])
def test_fast_greedy_tokens_on_mamba2_layers_are_exllamav3s(runtimes: tuple[str, Any, Any], jobs: int) -> None:
    name, plain, fast = runtimes
    graphs = fast.diagnostics()["fast_decode"].graphs
    replays, eager = graphs.replays, dict(graphs.eager)
    texts = prompts(jobs)
    kw = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    want = [r.token_ids for r in plain.batch(texts, **kw)]
    got = [r.token_ids for r in fast.batch(texts, **kw)]
    report = graphs.report()
    more = {k: n - eager.get(k, 0) for k, n in graphs.eager.items() if n > eager.get(k, 0)}
    print(
        f"{name} mamba, {jobs} jobs: {'identical' if got == want else 'DIFFERENT'}; replays "
        f"+{graphs.replays - replays}, eager {more}; {report}"
    )
    assert got == want, f"{name}, {jobs} jobs"
    assert report["captured"] is True, report
    assert report["capture_failed"] == {}
    assert report["recurrent_layers"] == {"Mamba2": 7}, report
    assert not [k for k in more if "capture failed" in k or "too many" in k or k == "recurrent state"], more
    if jobs >= report["min_rows"]:  # every decode step after its shape's first (jobs start as their prompts finish)
        assert graphs.replays - replays >= NEW // 2, report
    else:  # exllamav3's own graphed BC_Mamba2 (EXL3 weights, up to 8 rows): its steps left to it, and counted so
        assert more.get(OWN_ROWS, 0) >= NEW // 2, more


def test_the_report_says_the_mamba2_layers_were_captured(runtimes: tuple[str, Any, Any]) -> None:
    name, _, fast = runtimes
    report = fast.diagnostics()["fast_decode"].report()["graphs"]
    print(f"{name} mamba report: {report}")
    assert report["captured"] is True and report["recurrent_layers"] == {"Mamba2": 7}
    assert report["min_rows"] == (9 if name.endswith("exl3") else 1)  # exllamav3's own BC_Mamba2: EXL3 only
    assert report["run_ahead"]["launched"] == 0  # a recurrent step writes its state in place: never run ahead
