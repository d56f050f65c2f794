"""``decode="fast"`` on sliding-window rings (issue 53): GPT-OSS (4-bit EXL3) and Gemma 4 (bf16) against exllamav3's
own loop, their decode steps captured (tests/ring_models.py builds both with transformers' own classes).

The prompts are 735-780 tokens, so that within the 40 tokens each job draws its ring (768 tokens at window 128)
reaches its end on different steps for different rows: those steps move the row's ring a page down before the replay
(exllamav3's own ``_decode_state_prep`` on those rows) and the graph reads the static page tables and lengths. Greedy
tokens must be exllamav3's own at 1, 8, 16 and 64 jobs, the steps after each shape's first replayed, and the report
must say the rings were captured and how many row shifts ran. GPT-OSS's MoE layers (EXL3 experts with biases and
its own activation: exllamav3 1.6.5 has no fused expert buffers for them) are captured up to 8 rows only, its steps
of more rows run eagerly and the report says so (``fast/seam/moe.py``); Gemma 4 (no MoE) is captured at every count.

Run on the lent GPU: ``bash tests/gpu/run_on_device.sh swa`` (or ``pytest -m gpu tests/gpu/test_gpu_fast_rings.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ring_models import FIXTURES, RING_TOKENS

from helpers import plain_and_fast

pytestmark = pytest.mark.gpu
NEW = 40
WORDS = "the sea and its tides its fish its ships a harbour at dawn the wind in the sails".split()


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def runtimes(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, Any]]:
    with plain_and_fast(request.param, FIXTURES, cache_size=65536) as loaded:  # 64 jobs x ~820 tokens
        yield loaded


def prompts(rt: Any, n: int) -> list[str]:
    """``n`` prompts of 735-780 tokens (as ``rt`` encodes them), no two of one length where n allows."""
    out = []
    for i in range(n):
        target = 735 + (i * 37) % 46
        words = [WORDS[(i + j) % len(WORDS)] for j in range(target)]
        lo, hi = 1, len(words)
        while lo < hi:  # the most words whose encoding is at most `target` tokens
            mid = (lo + hi + 1) // 2
            if len(rt.encode(" ".join(words[:mid]))) <= target:
                lo = mid
            else:
                hi = mid - 1
        out.append(" ".join(words[:lo]))
    return out


def spans(text: str) -> set[int]:
    """The report's ``"1-8, 10"`` -> ``{1, ..., 8, 10}``."""
    rows: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("-")
        rows.update(range(int(a), int(b or a) + 1))
    return rows


@pytest.mark.parametrize("jobs", [1, 8, 16, 64])
def test_fast_greedy_tokens_on_sliding_window_rings_are_exllamav3s(runtimes: tuple[str, Any, Any], jobs: int) -> None:
    name, plain, fast = runtimes
    graphs = fast.diagnostics()["fast_decode"].graphs
    replays, eager = graphs.replays, dict(graphs.eager)
    shifts = graphs.view.rings.shifts if graphs.view.rings is not None else 0
    texts = prompts(fast, jobs)
    lengths = [len(fast.encode(t)) for t in texts]
    kw = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    want = [r.token_ids for r in plain.batch(texts, **kw)]
    got = [r.token_ids for r in fast.batch(texts, **kw)]
    report = graphs.report()
    more = {k: n - eager.get(k, 0) for k, n in graphs.eager.items() if n > eager.get(k, 0)}
    crossing = sum(1 for n in lengths if n < RING_TOKENS <= n + NEW - 1)
    print(
        f"{name} rings, {jobs} jobs (prompts {min(lengths)}-{max(lengths)} tokens, {crossing} rows crossing the ring's "
        f"end while decoding): {'identical' if got == want else 'DIFFERENT'}; replays +{graphs.replays - replays}, "
        f"eager {more}, row shifts +{report.get('rings', {}).get('row_shifts', 0) - shifts}; {report}"
    )
    assert got == want, f"{name}, {jobs} jobs"
    assert report["captured"] is True, report
    assert report["capture_failed"] == {}
    assert report["rings"]["ring_tokens"] == RING_TOKENS and report["rings"]["layers"] >= 4, report
    assert not [k for k in more if "recurrent" in k or "capture failed" in k or "too many" in k], more
    moe = report.get("moe")
    if moe is None or jobs in spans(moe["captured_rows"]):
        # every decode step after its shape's first (jobs start as their prompts' chunks finish: several shapes)
        assert graphs.replays - replays >= NEW // 2, report
        assert not [k for k in more if k.startswith("MoE")], more
        if crossing:  # rows reached their ring's end between replays of the captured graph: shifted before them
            assert report["rings"]["row_shifts"] - shifts >= 1, report
    else:  # more rows than its MoE layers serve without a host read: eager, and the report says which and why
        assert [k for k in more if k.startswith("MoE layers ran eagerly")], more


def test_the_report_says_the_rings_were_captured(runtimes: tuple[str, Any, Any]) -> None:
    name, _, fast = runtimes
    report = fast.diagnostics()["fast_decode"].report()["graphs"]
    print(f"{name} rings report: {report}")
    assert report["captured"] is True and report["min_rows"] == 1
    assert report["rings"]["window"] == 127 and report["rings"]["row_shifts"] > 0
    assert report["run_ahead"]["launched"] == 0  # a ring step writes its rings in place: never run ahead
